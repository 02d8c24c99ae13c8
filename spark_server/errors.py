"""Spark error codes, and the one place engine errors become Spark codes.

The spec's codes are kept exactly; conditions the spec does not cover borrow the public Spark
API's codes (10110, 11200, 11203) or take a code from this server's own 12000-12999 range.
"""

from __future__ import annotations

from enum import IntEnum

from bridges.common import BridgeError
from engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
    InferenceError,
    InvalidRequestError,
    LoraUnavailableError,
    PromptTooLongError,
    RequestTimeoutError,
)


class SparkCode(IntEnum):
    SUCCESS = 0
    UNKNOWN = -1  # 未知异常
    JSON_PARSE_ERROR = 4  # 请求体JSON解析错误
    SCHEMA_ERROR = 10000  # schema校验错误
    NO_DIALOGUE_CONTENT = 10002  # 缺少对话内容
    TOKEN_LIMIT_EXCEEDED = 10003  # 输入文本超过token限制
    SERVER_BUSY = 10110  # public Spark API: server busy (wait queue full)
    INFERENCE_ERROR = 11000  # GPT推理模块会话异常
    AUTH_FAILED = 11200  # public Spark API: authorization failed
    LORA_NOT_AVAILABLE = 12000  # this server: LoRA is not enabled here
    LORA_HOST_NOT_ALLOWED = 12001  # the pack URL is not http(s) or not under an allowed prefix
    LORA_DOWNLOAD_FAILED = 12002  # the pack server failed or answered non-200
    LORA_DOWNLOAD_TIMEOUT = 12003
    LORA_TOO_LARGE = 12004  # over --lora-max-pack-mb
    LORA_MD5_MISMATCH = 12005
    LORA_INVALID_PACK = 12006  # not a safe tar/zip with adapter_config.json + adapter_model.safetensors
    LORA_INCOMPATIBLE = 12007  # ranks, target modules or shapes do not fit the served model
    REQUEST_TIMEOUT = 12100  # this server: the request's deadline passed
    SERVER_SHUTTING_DOWN = 12101  # this server: shutdown ended the session
    ENGINE_UNAVAILABLE = 12102  # this server as a front end: no backend of the fleet can take the session


DESCRIPTIONS: dict[SparkCode, str] = {
    SparkCode.SUCCESS: "success",
    SparkCode.UNKNOWN: "unknown error",
    SparkCode.JSON_PARSE_ERROR: "the request frame is not valid JSON",
    SparkCode.SCHEMA_ERROR: "the request violates the schema; the message names the JSON path",
    SparkCode.NO_DIALOGUE_CONTENT: "no dialogue content: empty text list or empty latest user question",
    SparkCode.TOKEN_LIMIT_EXCEEDED: "the dialogue is over the token limit (set adjustTokens to trim history)",
    SparkCode.SERVER_BUSY: "the server's wait queue is full; retry later",
    SparkCode.INFERENCE_ERROR: "the inference session failed",
    SparkCode.AUTH_FAILED: "authorization failed",
    SparkCode.LORA_NOT_AVAILABLE: "LoRA is not enabled on this server (--lora-allowed-urls)",
    SparkCode.LORA_HOST_NOT_ALLOWED: "the LoRA pack URL is not http(s) or not under an allowed prefix",
    SparkCode.LORA_DOWNLOAD_FAILED: "the LoRA pack could not be downloaded",
    SparkCode.LORA_DOWNLOAD_TIMEOUT: "the LoRA pack download timed out",
    SparkCode.LORA_TOO_LARGE: "the LoRA pack is over the size limit",
    SparkCode.LORA_MD5_MISMATCH: "the LoRA pack's md5 differs from the request's",
    SparkCode.LORA_INVALID_PACK: "the LoRA pack is not a valid, safe pack",
    SparkCode.LORA_INCOMPATIBLE: "the LoRA adapter does not fit the served model",
    SparkCode.REQUEST_TIMEOUT: "the request's deadline passed before the answer finished",
    SparkCode.SERVER_SHUTTING_DOWN: "the server is shutting down",
    SparkCode.ENGINE_UNAVAILABLE: "no engine backend can take the session now (--engine-url fleet down); retry later",
}


class SparkError(Exception):
    def __init__(self, code: SparkCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trace_id: str | None = None  # the request's traceId, once it is known


_LORA_CODES = {
    "host_not_allowed": SparkCode.LORA_HOST_NOT_ALLOWED, "download_failed": SparkCode.LORA_DOWNLOAD_FAILED,
    "download_timeout": SparkCode.LORA_DOWNLOAD_TIMEOUT, "too_large": SparkCode.LORA_TOO_LARGE,
    "md5_mismatch": SparkCode.LORA_MD5_MISMATCH, "invalid_pack": SparkCode.LORA_INVALID_PACK,
    "incompatible": SparkCode.LORA_INCOMPATIBLE,
}


def spark_error_from(exc: BaseException) -> SparkError:
    if isinstance(exc, SparkError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return SparkError(SparkCode.TOKEN_LIMIT_EXCEEDED, str(exc))
    if isinstance(exc, InvalidRequestError):
        where = f"{exc.parameter}: " if exc.parameter and exc.parameter not in str(exc) else ""
        return SparkError(SparkCode.SCHEMA_ERROR, f"{where}{exc}")
    if isinstance(exc, BridgeError) and exc.status < 500:  # a request field the shared lowering refused
        return SparkError(SparkCode.SCHEMA_ERROR, exc.message)
    if isinstance(exc, EngineOverloadedError):
        return SparkError(SparkCode.SERVER_BUSY, str(exc))
    if isinstance(exc, LoraUnavailableError):
        return SparkError(_LORA_CODES.get(exc.code, SparkCode.LORA_NOT_AVAILABLE), str(exc))
    if isinstance(exc, RequestTimeoutError):
        return SparkError(SparkCode.REQUEST_TIMEOUT, str(exc))
    if isinstance(exc, EngineShutdownError):
        return SparkError(SparkCode.SERVER_SHUTTING_DOWN, str(exc))
    if isinstance(exc, EngineUnavailableError):
        return SparkError(SparkCode.ENGINE_UNAVAILABLE, str(exc))
    if isinstance(exc, (InferenceError, EngineError)):
        return SparkError(SparkCode.INFERENCE_ERROR, str(exc))
    return SparkError(SparkCode.UNKNOWN, f"unexpected error: {type(exc).__name__}")


def http_status_for(code: SparkCode) -> int:
    if code in (SparkCode.JSON_PARSE_ERROR, SparkCode.SCHEMA_ERROR, SparkCode.NO_DIALOGUE_CONTENT,
                SparkCode.TOKEN_LIMIT_EXCEEDED) or 12000 <= code < 12100:
        return 400
    if code == SparkCode.AUTH_FAILED:
        return 401
    if code == SparkCode.SERVER_BUSY:
        return 429
    if code in (SparkCode.SERVER_SHUTTING_DOWN, SparkCode.ENGINE_UNAVAILABLE):
        return 503
    if code == SparkCode.REQUEST_TIMEOUT:
        return 504
    return 500
