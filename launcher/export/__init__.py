"""What a spec becomes for a system that runs it by itself: Kubernetes manifests (k8s)."""
