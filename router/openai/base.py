"""What every OpenAI-layer module shares: the strict request model base, the 400 that names its field, and the
error body. Requests: router/openai/protocol.py (sampling, prompts, structured outputs), router/openai/tools.py
(tools and their history); responses: router/openai/response_builder.py, router/openai/assistant_message.py."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from engine.errors import InvalidRequestError


class BadRequest(InvalidRequestError):
    """An invalid request whose offending field is known (it goes into the error body's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StrictModel(BaseModel):
    """Parsed in strict JSON mode (``"max_tokens": "5"`` is a 400, not a 5); an explicit null means the field's
    default; fields we do not know are ignored (OpenAI's clients send fields of newer API versions)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI marks most fields nullable and clients send {"stream": null}: treat it as absent
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
