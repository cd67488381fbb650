"""The world the operator talks to: the Kubernetes API, the watch-fed cache, worker pods
(metrics and control calls), the scrape scheduler, the operator's own metrics and traces."""
