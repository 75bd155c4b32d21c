"""The thinking spans of the families whose templates show one (``reasoning-parser`` names)."""

from __future__ import annotations

from superfluid.core.formats.family import ReasoningFormat

THINK = ReasoningFormat("think", "<think>", "</think>",
                        "<think>...</think> (Qwen3, QwQ, DeepSeek R1, GLM, MiniMax, Kimi, Nemotron, SmolLM3)")

REASONING_FORMATS = (THINK,)

FORMATS = REASONING_FORMATS
