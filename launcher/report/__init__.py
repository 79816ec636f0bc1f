"""distlaunch.launcher.report: a run told as a picture (`distlaunch report`, `Run.report()`)."""
