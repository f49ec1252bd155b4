"""servelab's engine: a step-through, vLLM-style LLM inference engine you can read in a weekend."""

from engine.loader import load_model

__all__ = ["load_model"]
