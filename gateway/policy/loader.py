"""The only module that reads YAML. Errors carry PATH:LINE:COL. (Stub: the policy work fills it.)"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from gateway.errors import PolicyError
from gateway.policy.model import Policy


def load_policy(path: Path) -> Policy:
    try:
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        return Policy.model_validate(data)
    except (OSError, yaml.YAMLError) as e:
        raise PolicyError([f"{path}:1:1: {e}"]) from e
    except ValidationError as e:
        raise PolicyError([f"{path}:1:1: {err['msg']}" for err in e.errors()]) from e
