"""The one error table: every refusal and failure the server answers, each kind with its HTTP status, its
Spark codes (the seed document's and iFlytek's public form's), its OpenAI and Anthropic types and its
OpenAI ``code``. An ``ErrorInfo`` is one such error with its message and the parameter it names; every
protocol and every middleware only renders one. The engine's exception tree (engine/errors.py), the
protocols' own refusals (``BridgeError``, ``SparkError``) and anything unexpected become an ``ErrorInfo``
in one place, ``error_info``.

The Spark codes are the seed document's (-1, 4, 10000, 10002, 10003, 11000); conditions it does not cover
borrow the public Spark API's codes (10110, 11200) or take one from this server's 12000-12999 range. The
public form answers iFlytek's codes where they differ (``PublicCode``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import IntEnum

from engine.errors import (
    EngineError,
    EngineOverloadedError,
    EngineShutdownError,
    EngineUnavailableError,
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


class PublicCode(IntEnum):
    """iFlytek's public codes for the conditions whose seed-document code means something else there."""

    MESSAGE_FORMAT = 10003  # 用户的消息格式有错误 (the frame is not JSON)
    ENGINE_INTERNAL = 10012  # 引擎内部错误
    PARAMETER_CHECK = 10163  # 请求引擎的参数异常，引擎的schema检查不通过
    TOKEN_LIMIT = 10907  # token数量超过上限
    AUTH = 11200  # 授权错误：该appId没有相关功能的授权


@dataclass(frozen=True)
class Kind:
    """One row of the table: how every protocol names this kind of error."""

    status: int  # HTTP status (a protocol may answer its own for a few: Anthropic's 529, TGI's 422)
    spark: SparkCode  # the seed document's code
    public: int  # iFlytek's public form's code
    openai_type: str  # OpenAI's (and vLLM's, SGLang's, MindIE's) error type
    anthropic_type: str
    code: str | None = None  # OpenAI's error code (None: the status)


_BAD = "invalid_request_error"
_S = SparkCode
_P = PublicCode

# kind -> how each protocol says it; the first kind with a Spark code is what a SparkError of that code is
KINDS: dict[str, Kind] = {
    "invalid_json": Kind(400, _S.JSON_PARSE_ERROR, _P.MESSAGE_FORMAT, _BAD, _BAD, "invalid_json"),
    "invalid_request": Kind(400, _S.SCHEMA_ERROR, _P.PARAMETER_CHECK, _BAD, _BAD),
    "no_dialogue": Kind(400, _S.NO_DIALOGUE_CONTENT, _P.PARAMETER_CHECK, _BAD, _BAD),
    "prompt_too_long": Kind(400, _S.TOKEN_LIMIT_EXCEEDED, _P.TOKEN_LIMIT, _BAD, _BAD, "context_length_exceeded"),
    "not_found": Kind(404, _S.SCHEMA_ERROR, _P.PARAMETER_CHECK, _BAD, "not_found_error"),
    "model_not_found": Kind(404, _S.LORA_NOT_AVAILABLE, _S.LORA_NOT_AVAILABLE, "NotFoundError", "not_found_error",
                            "model_not_found"),
    # a LoRA pack (by URL) on a server without LoRA: the request's field is refused, nothing is missing
    "lora_disabled": Kind(400, _S.LORA_NOT_AVAILABLE, _S.LORA_NOT_AVAILABLE, _BAD, _BAD, "lora_disabled"),
    # a bad pack is the client's (400); a pack server that fails or is slow is upstream's (502 / 504)
    "lora_host_not_allowed": Kind(400, _S.LORA_HOST_NOT_ALLOWED, _S.LORA_HOST_NOT_ALLOWED, _BAD, _BAD,
                                  "lora_host_not_allowed"),
    "lora_download_failed": Kind(502, _S.LORA_DOWNLOAD_FAILED, _S.LORA_DOWNLOAD_FAILED, "bad_gateway", "api_error",
                                 "lora_download_failed"),
    "lora_download_timeout": Kind(504, _S.LORA_DOWNLOAD_TIMEOUT, _S.LORA_DOWNLOAD_TIMEOUT, "timeout_error",
                                  "timeout_error", "lora_download_timeout"),
    "lora_too_large": Kind(400, _S.LORA_TOO_LARGE, _S.LORA_TOO_LARGE, _BAD, _BAD, "lora_too_large"),
    "lora_md5_mismatch": Kind(400, _S.LORA_MD5_MISMATCH, _S.LORA_MD5_MISMATCH, _BAD, _BAD, "lora_md5_mismatch"),
    "lora_invalid_pack": Kind(400, _S.LORA_INVALID_PACK, _S.LORA_INVALID_PACK, _BAD, _BAD, "lora_invalid_pack"),
    "lora_incompatible": Kind(400, _S.LORA_INCOMPATIBLE, _S.LORA_INCOMPATIBLE, _BAD, _BAD, "lora_incompatible"),
    "unauthorized": Kind(401, _S.AUTH_FAILED, _P.AUTH, "authentication_error", "authentication_error"),
    "forbidden": Kind(403, _S.AUTH_FAILED, _P.AUTH, "permission_error", "permission_error"),
    "body_timeout": Kind(408, _S.SCHEMA_ERROR, _P.PARAMETER_CHECK, _BAD, _BAD),
    "body_too_large": Kind(413, _S.SCHEMA_ERROR, _P.PARAMETER_CHECK, _BAD, "request_too_large"),
    "unsupported_media_type": Kind(415, _S.SCHEMA_ERROR, _P.PARAMETER_CHECK, _BAD, _BAD),
    "overloaded": Kind(429, _S.SERVER_BUSY, _S.SERVER_BUSY, "rate_limit_error", "overloaded_error", "server_busy"),
    "timeout": Kind(504, _S.REQUEST_TIMEOUT, _S.REQUEST_TIMEOUT, "timeout_error", "timeout_error", "timeout"),
    "shutting_down": Kind(503, _S.SERVER_SHUTTING_DOWN, _S.SERVER_SHUTTING_DOWN, "service_unavailable",
                          "overloaded_error", "shutting_down"),
    "engine_unavailable": Kind(503, _S.ENGINE_UNAVAILABLE, _S.ENGINE_UNAVAILABLE, "service_unavailable",
                               "overloaded_error", "engine_unavailable"),
    "inference_error": Kind(500, _S.INFERENCE_ERROR, _P.ENGINE_INTERNAL, "internal_server_error", "api_error",
                            "inference_error"),
    "internal": Kind(500, _S.UNKNOWN, _P.ENGINE_INTERNAL, "internal_server_error", "api_error"),
}

# a LoraUnavailableError's cause -> its kind; any other cause (an adapter not registered, LoRA off for a
# name) is the model the request named not being served: 404
LORA_KINDS = {"packs_disabled": "lora_disabled", "host_not_allowed": "lora_host_not_allowed",
              "download_failed": "lora_download_failed", "download_timeout": "lora_download_timeout",
              "too_large": "lora_too_large", "md5_mismatch": "lora_md5_mismatch",
              "invalid_pack": "lora_invalid_pack", "incompatible": "lora_incompatible"}
# the engine's errors in the order they are tested (a subclass before its base)
ENGINE_KINDS: tuple[tuple[type[Exception], str], ...] = (
    (PromptTooLongError, "prompt_too_long"), (InvalidRequestError, "invalid_request"),
    (EngineOverloadedError, "overloaded"), (RequestTimeoutError, "timeout"), (EngineShutdownError, "shutting_down"),
    (EngineUnavailableError, "engine_unavailable"), (EngineError, "inference_error"),
)
# a status a protocol raises its refusal with -> its kind
KIND_OF_STATUS = {400: "invalid_request", 404: "not_found", 422: "invalid_request"}
# a Spark code -> the kind a SparkError of that code is (the first kind in the table with it)
KIND_OF_SPARK_CODE = {int(k.spark): name for name, k in reversed(KINDS.items())}


@dataclass(frozen=True)
class ErrorInfo:
    """One error as every protocol can render it."""

    kind: str  # a key of KINDS
    message: str  # names the field or the cause
    param: str | None  # the request field it is about, in the protocol's own spelling, if any
    status: int  # HTTP status
    spark_code: int  # the Spark seed form's header.code
    public_code: int  # the Spark public form's header.code
    openai_type: str
    anthropic_type: str
    code: str | None  # OpenAI's error code

    @classmethod
    def of(cls, kind: str, message: str, param: str | None = None, status: int | None = None,
           code: str | None = None) -> ErrorInfo:
        """An error of ``kind``; ``status``, ``code``: where the raiser says more than the kind does (TGI's
        422, the OpenAI Responses API's own codes)."""
        row = KINDS[kind]
        return cls(kind, message, param, row.status if status is None else status, int(row.spark), int(row.public),
                   row.openai_type, row.anthropic_type, code or row.code)

    def with_status(self, status: int) -> ErrorInfo:
        return self if status == self.status else replace(self, status=status)

    @property
    def retry_after(self) -> bool:
        """Whether trying again later may succeed (a busy server, one shutting down): said with Retry-After."""
        return self.status in (429, 503, 529)


class BridgeError(Exception):
    """A request a protocol refuses, raised with its status (400: the request is invalid, 404: what it
    names is not served) or a kind of the table; each protocol renders its ``info``."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.info = ErrorInfo.of(kind or KIND_OF_STATUS[status], message, param, status, code)

    @property
    def status(self) -> int:
        return self.info.status

    @property
    def message(self) -> str:
        return self.info.message

    @message.setter
    def message(self, value: str) -> None:
        self.info = replace(self.info, message=value)

    @property
    def param(self) -> str | None:
        return self.info.param

    @param.setter
    def param(self, value: str | None) -> None:
        self.info = replace(self.info, param=value)


class SparkError(BridgeError):
    """A Spark request refused with one of the Spark codes (the kind is the table's for that code)."""

    def __init__(self, code: SparkCode, message: str) -> None:
        kind = KIND_OF_SPARK_CODE[int(code)]
        super().__init__(KINDS[kind].status, message, kind=kind)

    @property
    def code(self) -> SparkCode:
        return SparkCode(self.info.spark_code)


def error_info(exc: BaseException) -> ErrorInfo:
    """The one mapping from whatever was raised to the error every protocol renders."""
    if isinstance(exc, BridgeError):
        return exc.info
    if isinstance(exc, LoraUnavailableError):
        return ErrorInfo.of(LORA_KINDS.get(exc.code, "model_not_found"), str(exc), "model")
    for cls, kind in ENGINE_KINDS:
        if isinstance(exc, cls):
            return ErrorInfo.of(kind, str(exc), getattr(exc, "parameter", None))
    return ErrorInfo.of("internal", f"unexpected error: {type(exc).__name__}")
