"""LoRA packs: download by URL, md5 check, safe unpacking, content cache (see the LoRA issue)."""
