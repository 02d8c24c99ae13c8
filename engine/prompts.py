"""Prompts to token ids: chat templating, tokenizing, truncation and the context-length checks.

One job, shared by the local engine and the fleet client (fleet/client.py), so a front end with no
model counts tokens, fits histories and refuses long prompts exactly as a server with one does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import EngineOverloadedError, InvalidRequestError, PromptTooLongError
from engine.request import ChatPrompt, Prompt, TextPrompt, TokensPrompt
from engine.template_sandbox import render_request_template, shared_sandbox


def read_chat_template(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM takes it)."""
    path = Path(value).expanduser()
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r}: neither a file nor a Jinja template")
    return value


class PromptEncoder:
    """Templates and tokenizes prompts for one tokenizer and context length (thread-safe: the
    tokenizer is only read)."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_bytes_per_token = self._max_bytes_per_token()
        self.message_floor_by_role = self._message_floors_by_role()

    def _max_bytes_per_token(self) -> int:
        """Most input bytes one token can stand for: twice the longest token's UTF-8 text, a margin for
        tokenizers whose normalisation drops characters. ``len(text bytes) // this`` is then a floor on
        the token count, known without tokenizing (a 4 MB prompt is refused in microseconds)."""
        ids = [[i] for i in range(len(self.tokenizer))]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)  # fast tokenizers: one Rust batch call
        texts = (backend.decode_batch(ids, skip_special_tokens=False) if backend is not None
                 else [self.tokenizer.decode(i) for i in ids])
        return 2 * max(max(len(t.encode()) for t in texts), 1)

    def _message_floors_by_role(self) -> dict[str, int]:
        """A floor, per role, on the tokens the model's own chat template adds for a message around its
        content (role markers, separators), so a conversation of many tiny messages is refused before it is
        rendered: rendering and tokenizing 16,000 of them took seconds of the serving process's CPU only to
        exceed the context. Measured once per role by appending a one-letter message to a short
        conversation, one token taken off for the content and one for merges at its edges; 0 for a role the
        template drops, refuses or renders no larger (nothing is charged for it then)."""
        def count(messages: list[dict[str, str]]) -> int:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            return len(self.tokenizer.encode(text, add_special_tokens=False))

        base = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}]
        floors: dict[str, int] = {}
        try:
            before = count(base)
        except Exception:  # no template, or one that wants another shape (a system message first, ...)
            return floors
        for role in ("system", "user", "assistant", "tool"):
            message = {"role": role, "content": "a"}
            try:  # the smaller of the message last and in the middle (a template may mark the last turn)
                added = min(count([*base, message]), count([base[0], message, base[1]])) - before
            except Exception:  # a role this template refuses there: charged nothing
                added = 0
            floors[role] = max(0, added - 2)
        return floors

    def min_num_tokens(self, texts: list[str]) -> int:
        """A floor on the tokens ``texts`` need, from their sizes alone."""
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) // self.max_bytes_per_token

    def encode(self, prompt: Prompt, truncate: int | None = None) -> list[int]:
        """Template and tokenize; ``truncate``: keep only the prompt's last so many tokens."""
        texts = ([m.content for m in prompt.messages] if isinstance(prompt, ChatPrompt)
                 else [prompt.text] if isinstance(prompt, TextPrompt) else [])
        floor = self.min_num_tokens(texts)
        if floor >= self.max_model_len and not truncate:
            raise PromptTooLongError(
                f"the prompt has at least {floor} tokens (from its size); this model's context is "
                f"{self.max_model_len} tokens", floor, self.max_model_len - 1)
        if (isinstance(prompt, ChatPrompt) and prompt.token_ids is None and prompt.chat_template is None
                and not truncate):
            floor += sum(self.message_floor_by_role.get(m.role, 0) for m in prompt.messages)
            if floor >= self.max_model_len:
                raise PromptTooLongError(
                    f"the conversation has {len(prompt.messages)} messages, at least {floor} tokens with this "
                    f"model's chat template; this model's context is {self.max_model_len} tokens", floor,
                    self.max_model_len - 1)
        if isinstance(prompt, ChatPrompt) and prompt.token_ids is not None:
            ids = list(prompt.token_ids)
        elif isinstance(prompt, ChatPrompt):
            ids = self.tokenizer.encode(self.render_chat(prompt), add_special_tokens=prompt.add_special_tokens)
        elif isinstance(prompt, TextPrompt):
            ids = self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        elif isinstance(prompt, TokensPrompt):
            ids = list(prompt.token_ids)
            self.check_in_vocab(ids, "prompt_token_ids")
        else:
            raise InvalidRequestError("unknown prompt type", parameter="prompt")
        if truncate and len(ids) > truncate:
            ids = ids[-truncate:]
        if not ids:
            raise InvalidRequestError("the prompt is empty", parameter="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                "and at least one must be left for the answer", len(ids), self.max_model_len - 1)
        return ids

    def render_chat(self, prompt: ChatPrompt) -> str:
        """The chat template's text for a conversation (the request's own template, if it brings one)."""
        if prompt.add_generation_prompt and prompt.continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true",
                                      parameter="continue_final_message")
        if prompt.continue_final_message and (not prompt.messages or prompt.messages[-1].role != "assistant"):
            raise InvalidRequestError("continue_final_message needs an assistant message last",
                                      parameter="continue_final_message")
        messages = []
        for m in prompt.messages:
            message: dict = {"role": m.role, "content": m.content}
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                message["reasoning_content"] = m.reasoning_content
            messages.append(message)
        extra = {"tools": prompt.tools} if prompt.tools else {}
        try:
            if prompt.chat_template is not None and not self._names_own_template(prompt.chat_template):
                return render_request_template(  # a client's Jinja: in the bounded sandbox
                    shared_sandbox(), prompt.chat_template, messages, special_tokens=self.tokenizer.special_tokens_map,
                    add_generation_prompt=prompt.add_generation_prompt,
                    continue_final_message=prompt.continue_final_message, tools=prompt.tools,
                    kwargs=prompt.chat_template_kwargs,
                    max_chars=max(4 << 20, self.max_model_len * self.max_bytes_per_token))
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message, chat_template=prompt.chat_template,
                **extra, **prompt.chat_template_kwargs)
        except (InvalidRequestError, EngineOverloadedError):
            raise
        except Exception as exc:  # a template that does not render these messages (jinja errors, raise_exception)
            parameter = "chat_template" if prompt.chat_template else "messages"
            raise InvalidRequestError(f"the chat template cannot render this conversation: {exc}",
                                      parameter=parameter) from None

    def _names_own_template(self, name: str) -> bool:
        """A tokenizer with several templates lets a request pick one by name (transformers' rule)."""
        own = self.tokenizer.chat_template
        return isinstance(own, dict) and name in own

    def check_in_vocab(self, ids: list[int], parameter: str) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"'{parameter}': token id {bad} is outside the vocabulary [0, {vocab})",
                                      parameter=parameter)
