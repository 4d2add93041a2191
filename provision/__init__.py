"""Standing up Orchard: on this machine (local engine) or on a Kubernetes cluster."""
