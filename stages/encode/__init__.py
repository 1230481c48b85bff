"""The encode stages: `images` -> `text` (`text.run`, Qwen2.5-VL prompt embeds) and `images` -> `vae`
(`vae.run`, target + control latents); `common` holds what both share (ranks, lineage, writer, batching).
"""
