"""distlaunch's launching side: spec, plan, transports, supervisor and the `distlaunch` CLI."""
