"""The local Hub's fixtures (tests/engine/hub/hub_repos.py) for every test here, and no ambient token."""
from __future__ import annotations

from tests.engine.hub.hub_repos import fake_hub, hub_lora, hub_models, no_ambient_token, settings  # noqa: F401 (fixtures)
