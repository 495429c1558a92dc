"""Ray Serve deployments: the HTTP ingress, the generator, and the app builder."""
