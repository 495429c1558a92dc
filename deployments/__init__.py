"""Ray Serve deployments: the HTTP ingress and its backend, the generator, the app config and builder."""
