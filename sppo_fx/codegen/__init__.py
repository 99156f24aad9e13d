"""Codegen: Inductor compilation of the chunk programs (C++ on CPU, Triton on GPU)."""
from sppo_fx.codegen.inductor import CompiledProgram, compile_chunk_program

__all__ = ["CompiledProgram", "compile_chunk_program"]
