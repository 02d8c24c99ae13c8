"""The scheduler's cost model: what a step's parts cost, in units of one prompt token's linears.

The loader measures it at start (the model's rates, kept by the tuning cache) or takes it pinned from
``--scheduler-cost-model``, so replicas on one hardware class schedule alike whatever each start measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLAG = "--scheduler-cost-model"
# the flag's keys -> the fields they set; each is required, so a pinned model never mixes in a measured figure
_KEYS = {"step": "decode_step_cost", "decode_key": "decode_cost_per_key", "attention_key": "attention_cost_per_key"}
# optional: a decoding row's own linears, 1 (a prompt token's) unless the two rows run in different modes
_ROW_KEY = "decode_row"


@dataclass(frozen=True, slots=True)
class CostModel:
    attention_cost_per_key: float = 0.0  # a prompt token's attention over one earlier key (0: tokens only)
    decode_cost_per_key: float = 0.0  # a decoding row's attention over one key of its context
    decode_step_cost: float = 0.0  # a decode step before any row (its pass over the weights)
    # a decoding row's own linears: more than a prompt token's where prompt rows take int8 activations and
    # decode rows exact ones (--linear-activations int8-prompt: the measured ratio of the two batch rates)
    decode_row_cost: float = 1.0
    measured: bool = False  # the decode figures stand for this machine (measured at start, or pinned)
    pinned: bool = False  # given by the flag rather than measured

    @property
    def source(self) -> str:
        """Where the figures come from, for the start-up line."""
        if self.pinned:
            return f"pinned by {FLAG}"
        return "measured" if self.measured else "the default figures"

    def describe(self) -> str:
        """The figures in the flag's own form: a start's measured model, ready to pin on its replicas."""
        figures = ",".join(f"{key}={getattr(self, name):.6g}" for key, name in _KEYS.items())
        return figures if self.decode_row_cost == 1.0 else f"{figures},{_ROW_KEY}={self.decode_row_cost:.6g}"

    @classmethod
    def parse(cls, value: str) -> CostModel:
        """``step=S,decode_key=D,attention_key=A`` and optionally ``decode_row=R`` (default 1): each a finite
        number >= 0; anything else is refused, naming the flag."""
        keys = {**_KEYS, _ROW_KEY: "decode_row_cost"}
        figures: dict[str, float] = {}
        for item in value.split(","):
            key, sep, number = item.partition("=")
            key = key.strip()
            if not sep or key not in keys:
                raise ValueError(f"{FLAG} {value!r}: expected {','.join(f'{k}=N' for k in _KEYS)} "
                                 f"(and optionally {_ROW_KEY}=N)")
            if keys[key] in figures:
                raise ValueError(f"{FLAG} {value!r}: {key} given twice")
            try:
                figure = float(number)
            except ValueError:
                raise ValueError(f"{FLAG} {value!r}: {key} is not a number") from None
            if not math.isfinite(figure) or figure < 0:
                raise ValueError(f"{FLAG} {value!r}: {key} must be a finite number >= 0")
            figures[keys[key]] = figure
        missing = [k for k, name in _KEYS.items() if name not in figures]
        if missing:
            raise ValueError(f"{FLAG} {value!r}: {', '.join(missing)} missing (all of step, decode_key and "
                             "attention_key are pinned together)")
        return cls(**figures, measured=True, pinned=True)
