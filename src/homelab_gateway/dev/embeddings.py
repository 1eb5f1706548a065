"""What the stub answers on /v1/embeddings, as vLLM writes it: deterministic vectors in every
`encoding_format` and dtype vLLM has, with its binary layouts and their `metadata` header."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import sys
from typing import Any

from homelab_gateway.dev.generation import (
    ENGINE_DIED,
    Batch,
    Exchange,
    HTTPError,
    batch,
    is_int,
    literal,
)
from homelab_gateway.dev.state import StubSettings

EMBEDDING_SCENARIOS = frozenset({"error500", "error400", "overloaded", "hangup", "fail"})
"""An embedding is one whole answer: only the refusals, the hang-up and the engine's death."""
ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
EMBED_DTYPES = ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2")
ENDIANNESS = ("native", "big", "little")


class Embedding(Batch, Exchange):
    """An embedding request (/v1/embeddings), as vLLM's ServingEmbedding answers it after
    `hold`: a deterministic vector per input as JSON floats or base64, or as raw bytes with a
    `metadata` header (`bytes`) or none (`bytes_only`)."""

    endpoint = "embeddings"
    prompt_field = "input"
    scenarios = EMBEDDING_SCENARIOS
    prefix_cache = False

    @classmethod
    def invalid(cls, body: dict[str, Any], settings: StubSettings) -> str | None:
        if "input" not in body:
            return "input: Field required"
        if batch(body["input"]) is None:
            return "input: Input should be a valid string"
        for name, allowed in (
            ("encoding_format", ENCODING_FORMATS),
            ("embed_dtype", EMBED_DTYPES),
            ("endianness", ENDIANNESS),
        ):
            if name in body and (problem := literal(name, body[name], allowed)):
                return problem
        dimensions = body.get("dimensions")
        if dimensions is None:
            return None
        if not is_int(dimensions):
            return "dimensions: Input should be a valid integer"
        if not settings.matryoshka:  # vLLM's PoolingParams.verify, with its served name
            return (
                f'Model "{body.get("model") or "stub"}" does not support matryoshka '
                "representation, changing output dimensions will lead to poor results."
            )
        if dimensions < 1:
            return "Dimensions must be greater than 0"
        return None

    @property
    def output_tokens(self) -> int:
        return 0  # a pooling request's room is the whole window (max_embed_len unset)

    def answer_whole(self) -> bytes:
        if self.scenario == "fail":
            raise HTTPError(500, ENGINE_DIED)
        size = min(self.stub.settings.embedding_size, self.body.get("dimensions") or 10**9)
        vectors = [embedding(item, size) for item in self._items()]
        encoding = self.body.get("encoding_format", "float")
        dtype = self.body.get("embed_dtype", "float32")
        endianness = self.body.get("endianness", "native")
        usage = {"prompt_tokens": self.prompt_tokens, "total_tokens": self.prompt_tokens}
        if encoding in ("bytes", "bytes_only"):
            blobs = [pack(vector, dtype, endianness) for vector in vectors]
            self.request.setHeader(b"content-type", b"application/octet-stream")
            if encoding == "bytes":
                items, start = [], 0
                for index, blob in enumerate(blobs):
                    items.append(
                        {
                            "index": index,
                            "embed_dtype": dtype,
                            "endianness": endianness,
                            "start": start,
                            "end": start + len(blob),
                            "shape": [len(vectors[index])],
                        }
                    )
                    start += len(blob)
                metadata = {
                    "id": f"embd-{self.id}",
                    "created": self.created,
                    "model": self.model,
                    "data": items,
                    "usage": usage,
                }
                self.request.setHeader(b"metadata", json.dumps(metadata).encode())
            return b"".join(blobs)
        data = [
            {
                "index": index,
                "object": "embedding",
                "embedding": vector
                if encoding == "float"
                else base64.b64encode(pack(vector, dtype, endianness)).decode(),
            }
            for index, vector in enumerate(vectors)
        ]
        response = {
            "id": f"embd-{self.id}",
            "object": "list",
            "created": self.created,
            "model": self.model,
            "data": data,
            "usage": {
                **usage,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
                "completion_tokens_details": None,
            },
        }
        return json.dumps(response, separators=(",", ":"), ensure_ascii=False).encode()


def embedding(item: str | list[int], size: int) -> list[float]:
    """A deterministic vector for one input, from a hash of it: each component ±(1 + m/4)·2**e
    with e in -6..-1, which every embed_dtype vLLM offers holds exactly (fp8 included), so float,
    base64 and bytes agree bit for bit. A shorter one is a prefix, as `dimensions` slices."""
    seed = json.dumps(item).encode()
    stream = b"".join(
        hashlib.sha256(seed + block.to_bytes(4, "big")).digest()
        for block in range(math.ceil(size / 32))
    )
    return [
        (-1 if b & 1 else 1) * (1 + (b >> 1 & 3) / 4) * 2.0 ** -(1 + (b >> 3) % 6)
        for b in stream[:size]
    ]


def _big_endian(value: float, dtype: str) -> bytes:
    """One component in `dtype`, most significant byte first. bfloat16 and fp8_e5m2 are the top
    of a float32 and of a float16, and e4m3fn is built from the exponent and 3 fraction bits:
    exact for the values `embedding` makes."""
    if dtype == "float32":
        return struct.pack(">f", value)
    if dtype == "float16":
        return struct.pack(">e", value)
    if dtype == "bfloat16":
        return struct.pack(">f", value)[:2]
    if dtype == "fp8_e5m2":
        return struct.pack(">e", value)[:1]
    mantissa, exponent = math.frexp(abs(value))  # fp8_e4m3: bias 7
    return bytes([(value < 0) << 7 | (exponent + 6) << 3 | round(mantissa * 16 - 8)])


def pack(vector: list[float], dtype: str, endianness: str) -> bytes:
    """vLLM's tensor2binary: the components in `dtype`, each in the byte order asked ("native"
    being this machine's)."""
    order = sys.byteorder if endianness == "native" else endianness
    parts = (_big_endian(value, dtype) for value in vector)
    return b"".join(part if order == "big" else part[::-1] for part in parts)
