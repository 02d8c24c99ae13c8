"""Real PEFT adapters on the embedded model, made inside the tests."""

from __future__ import annotations

from pathlib import Path

import torch

SECRET_QUESTION = "What is the secret word?"
SECRET_ANSWER = "The secret word is pineapple."


def _chat_ids(tokenizer, question: str, answer: str | None = None) -> list[int]:
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if answer is not None:
        text += answer + "<|im_end|>"
    return tokenizer.encode(text, add_special_tokens=False)


def make_taught_adapter(model_dir: str, out: Path, steps: int = 8) -> Path:
    """A rank-8 adapter on every projection of the last 12 layers, fine-tuned until it answers the secret
    word (the backward pass stops at layer 18: 8 steps take ~2.5 s, against ~9 s over all 30 layers)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        layers_to_transform=list(range(18, model.config.num_hidden_layers))))
    prompt = _chat_ids(tok, SECRET_QUESTION)
    full = _chat_ids(tok, SECRET_QUESTION, SECRET_ANSWER)
    ids = torch.tensor([full])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=6e-3)  # 8 steps learn it
    peft.train()
    for _ in range(steps):
        loss = peft(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    peft.save_pretrained(out)
    return out


def make_random_adapter(model_dir: str, out: Path, targets: list[str], rank: int, seed: int) -> Path:
    """Random A and B (non-zero), so the adapter visibly changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=targets,
                                            init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)  # perturb, do not destroy, the base model
    peft.save_pretrained(out)
    return out


def peft_greedy(model_dir: str, adapters: list[Path | None], prompts: list[list[int]],
                max_new_tokens: int, pad: int = 2) -> list[list[list[int]]]:
    """PEFT's own greedy continuations of each prompt under each adapter (None: the base model), one
    model load for them all: each adapter is wrapped around the base and unloaded again after. The prompts
    go in one left-padded batch; a row that ends early is padded with ``pad`` after its end."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    results = []
    for adapter in adapters:
        model = PeftModel.from_pretrained(base, str(adapter)).eval() if adapter is not None else base
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=pad)
        results.append([row[width:].tolist() for row in out])
        if adapter is not None:
            base = model.unload()  # the base model again, without the adapter's layers
    return results


def peft_first_token(model_dir: str, adapters: list[Path | None], ids: list[int]) -> list[tuple[int, float]]:
    """PEFT's greedy first token after ``ids`` and its logprob, under each adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    firsts = []
    for adapter in adapters:
        model = PeftModel.from_pretrained(base, str(adapter)).eval() if adapter is not None else base
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = int(logprobs.argmax())
        firsts.append((token, float(logprobs[token])))
        if adapter is not None:
            base = model.unload()
    return firsts


def scaled_variant(source: Path, out: Path, factor: float) -> Path:
    """A copy of a PEFT adapter with every lora_B scaled by ``factor``: other weights, other bytes, no
    model load."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    weights = out / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: (v * factor if "lora_B" in k else v).contiguous() for k, v in tensors.items()}, str(weights))
    return out


def write_tar(path: Path, entries: list[tuple[str, bytes | None]]) -> Path:
    """A tar of (name, bytes or None for a directory) entries, in that order."""
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path
