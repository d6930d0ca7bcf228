"""`headroom serve --replicas N`: a Ray Serve fleet of engines behind one port.

- `ingress`: the HTTP deployment; sizes each request's prompt and forwards it, serves the fleet's `/metrics`.
- `replica`: the engine deployment; one engine and controller each, running the one FastAPI app.
- `router` (Ray adapter) and `headroom_policy` (the pure choice): route by each replica's measured headroom.
- `forwarding`, `prompt_size`, `fleet_metrics`, `metrics_board`: what those share.
- `launcher`: start or join Ray, deploy, print the ready line, shut down on a signal.

Only these modules import Ray (the optional extra `headroom[ray]`).
"""
