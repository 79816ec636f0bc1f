"""The cluster spec: its typed, validated model and how a spec file is loaded (model), the
typed records it is made of (records), and where a raw spec comes from (sources)."""
