"""Fixture generation for diffrun: shapes, deterministic weights, ggml quantizers, GGUF vocabularies."""
