"""The cluster spec: what a valid spec is (schema: the JSON Schema, compiled into checker;
invalid turns its first violation into one line), where a raw spec comes from (sources: JSON,
YAML 1.2, `--set`, host files, `per_host`), and its typed model and how a spec file is loaded
(model)."""
