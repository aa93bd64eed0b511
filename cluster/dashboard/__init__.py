"""The operator dashboard: a live page at /dashboard on the router's HTTP port (no CDN, no build step).

    mount_dashboard(app, timeline)      # GET /dashboard (the page), GET /admin/timeline (its time series)

The page (static/) polls /admin/workers, /admin/autoscaler, /admin/access and /admin/timeline every 1.5 s
with the key the operator typed (reads follow the API-key rule) and draws its charts itself as SVG. Its
scaling controls call POST /admin/pools/{role}: the admin API is the only write path.

Pieces:
- timeline.py  Timeline (the time series, one point per second) and mount_dashboard
- static/      the page itself
"""
from __future__ import annotations

from cluster.dashboard.timeline import Timeline, mount_dashboard

__all__ = ["Timeline", "mount_dashboard"]
