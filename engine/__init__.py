"""The single-process engine core: runner, requests, the speculative step."""

from specray.engine.config import EngineConfig
from specray.engine.llm_engine import LLMEngine
from specray.engine.params import SamplingParams, SpeculationParams
from specray.engine.request import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "SpeculationParams"]
