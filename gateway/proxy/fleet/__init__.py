"""The view of every server behind the proxy at once, for operators: `/health` naming each, their
Prometheus series merged, the cache across them, pins everywhere, and the dashboard over them. One
view for proxy mode's upstreams and for the Ray ingress's engine replicas; which one (how servers
are named, what `/metrics` shows) is chosen when the app is built (`view.py`)."""
