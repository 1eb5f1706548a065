"""The stub's /v1/completions and /v1/embeddings (and chat's created_cache_tokens) on loopback:
vLLM's bodies field by field, the pacing on a Clock, the scenarios, the log and the counters."""

from __future__ import annotations

import base64
import json
import struct
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import Clock
from twisted.trial.unittest import TestCase

from homelab_gateway.dev.stub import StubLog, StubResource, StubSettings, stub_site
from tests.surfaces.test_proxy import async_test
from testsupport.helpers import RawResponse, Servers, raw_request, wait_for

WORDS = "Hello! I am a stub model"  # the stub's CONTENT_TEXT, word by word


class FieldLog(StubLog):
    """The stub's log in memory, each line with its fields."""

    def __init__(self) -> None:
        super().__init__(None)
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def write(self, event: str, request_id: str, **fields: Any) -> None:
        self.lines.append((event, request_id, fields))

    def events(self, name: str) -> list[tuple[str, str, dict[str, Any]]]:
        return [line for line in self.lines if line[0] == name]


def events(response: RawResponse) -> list[Any]:
    """The SSE body's `data:` events, parsed ([DONE] as the string)."""
    out = []
    for block in response.body_text().split("\n\n"):
        if block:
            assert block.startswith("data: ") and "\n" not in block, block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_chunk(
    created: int,
    text: str,
    finish: str | None = None,
    stop_reason: str | None = None,
    *,
    index: int = 0,
    request: str = "1",
) -> dict[str, Any]:
    """One of vLLM's CompletionStreamResponse chunks (exclude_unset: no usage key)."""
    return {
        "id": f"cmpl-{request}",
        "object": "text_completion",
        "created": created,
        "model": "m",
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "prompt_token_ids": None,
                "token_ids": None,
            }
        ],
    }


def completion(prompt: Any = "tell me", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, **extra}


class StubCase(TestCase):
    def setUp(self) -> None:
        self.servers = Servers(self)

    def serve(self, clock: Clock | None = None, **settings: Any) -> None:
        self.log = FieldLog()
        site = stub_site(StubSettings(**settings), clock or reactor, self.log)
        assert isinstance(site.resource, StubResource)
        self.stub = site.resource
        self.port = self.servers.listen(site)

    async def post(self, path: str, body: Any) -> RawResponse:
        response = raw_request(self.port, "POST", path, body)
        await response.closed
        return response

    def error(self, response: RawResponse) -> dict[str, Any]:
        self.assertEqual(response.header("content-type"), "application/json")
        return json.loads(response.body_text())["error"]


class CompletionStreams(StubCase):
    @async_test
    async def test_a_stream_is_vllms_chunks_an_eos_chunk_and_done(self) -> None:
        self.serve(content_tokens=3)
        response = await self.post("/v1/completions", completion(stream=True, max_tokens=10))
        self.assertEqual(response.status, 200)
        self.assertEqual(response.header("content-type"), "text/event-stream")
        created = events(response)[0]["created"]
        expected = [
            text_chunk(created, "Hello! "),
            text_chunk(created, "I "),
            text_chunk(created, "am "),
            text_chunk(created, "", "stop"),  # vLLM's EOS token: no text, one token
        ]
        self.assertEqual(  # byte for byte: pydantic's compact JSON in field order
            response.body_text(),
            "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in expected)
            + "data: [DONE]\n\n",
        )
        self.assertEqual(
            self.log.events("complete")[0][2],
            {"endpoint": "completions", "finish": "stop", "tokens": 4},
        )

    @async_test
    async def test_max_tokens_defaults_to_16_and_the_last_token_says_length(self) -> None:
        self.serve(content_tokens=40)
        body = completion(stream=True, stream_options={"include_usage": True})
        got = events(await self.post("/v1/completions", body))
        tokens, usage, done = got[:-2], got[-2], got[-1]
        self.assertEqual(len(tokens), 16)
        self.assertEqual(
            [t["choices"][0]["finish_reason"] for t in tokens], [None] * 15 + ["length"]
        )
        self.assertNotIn("usage", tokens[0])
        self.assertEqual(
            usage,
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": tokens[0]["created"],
                "model": "m",
                "choices": [],
                "usage": {"prompt_tokens": 2, "total_tokens": 18, "completion_tokens": 16},
            },
        )
        self.assertEqual(done, "[DONE]")

    @async_test
    async def test_continuous_usage_is_on_every_chunk_and_details_only_on_the_last(self) -> None:
        self.serve(content_tokens=2, prompt_tokens_details=True)
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = completion("one two three", stream=True, stream_options=options)
        got = events(await self.post("/v1/completions", body))
        self.assertEqual(
            [c["usage"] for c in got[:3]],
            [
                {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n}
                for n in (1, 2, 3)
            ],
        )
        self.assertEqual(
            got[3]["usage"],
            {
                "prompt_tokens": 3,
                "total_tokens": 6,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": 0},
            },
        )

    @async_test
    async def test_a_list_of_prompts_streams_a_choice_each_and_sums_the_usage(self) -> None:
        self.serve(content_tokens=1)
        body = completion(["a b", "c d e"], stream=True, stream_options={"include_usage": True})
        got = events(await self.post("/v1/completions", body))
        created = got[0]["created"]
        self.assertEqual(
            got[:4],
            [
                text_chunk(created, "Hello! ", index=0),
                text_chunk(created, "Hello! ", index=1),
                text_chunk(created, "", "stop", index=0),
                text_chunk(created, "", "stop", index=1),
            ],
        )
        self.assertEqual(
            got[4]["usage"], {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}
        )

    @async_test
    async def test_stop_names_the_first_stop_string(self) -> None:
        self.serve(content_tokens=2)
        for stop in ("END", ["END", "FIN"]):
            got = events(
                await self.post("/v1/completions", completion("stop", stream=True, stop=stop))
            )
            self.assertEqual(got[-2]["choices"][0]["finish_reason"], "stop")
            self.assertEqual(got[-2]["choices"][0]["stop_reason"], "END")

    @async_test
    async def test_fail_sends_a_few_tokens_then_vllms_error_event_and_done(self) -> None:
        self.serve()
        got = events(await self.post("/v1/completions", completion("fail", stream=True)))
        self.assertEqual([c["choices"][0]["text"] for c in got[:2]], ["Hello! ", "I "])
        self.assertEqual(
            got[2:],
            [
                {
                    "error": {
                        "message": "stub: the engine died",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                },
                "[DONE]",
            ],
        )
        whole = await self.post("/v1/completions", completion("fail"))
        self.assertEqual(whole.status, 500)
        self.assertEqual(self.error(whole)["message"], "stub: the engine died")


class CompletionWhole(StubCase):
    @async_test
    async def test_the_whole_answer_is_vllms_text_completion_every_field(self) -> None:
        self.serve(content_tokens=3)
        response = await self.post("/v1/completions", completion(max_tokens=10))
        self.assertEqual(response.header("content-type"), "application/json")
        self.assertNotIn(b": ", response.body_bytes())  # starlette's compact JSON
        answer = json.loads(response.body_text())
        self.assertEqual(
            answer,
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": answer["created"],
                "model": "m",
                "choices": [
                    {
                        "index": 0,
                        "text": "Hello! I am ",
                        "logprobs": None,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                ],
                "service_tier": None,
                "system_fingerprint": None,
                "usage": {
                    "prompt_tokens": 2,
                    "total_tokens": 6,
                    "completion_tokens": 4,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            },
        )

    @async_test
    async def test_token_id_prompts_count_their_ids_and_long_is_2000_tokens(self) -> None:
        self.serve()
        one = json.loads((await self.post("/v1/completions", completion([5, 6, 7]))).body_text())
        self.assertEqual(one["usage"]["prompt_tokens"], 3)
        two = json.loads(
            (await self.post("/v1/completions", completion([[1, 2], [3, 4, 5]]))).body_text()
        )
        self.assertEqual([c["index"] for c in two["choices"]], [0, 1])
        self.assertEqual(two["usage"]["prompt_tokens"], 5)
        long = json.loads(
            (await self.post("/v1/completions", completion("long", max_tokens=5000))).body_text()
        )
        self.assertEqual(long["usage"]["completion_tokens"], 2001)  # and the EOS
        self.assertTrue(long["choices"][0]["text"].startswith(WORDS))

    @async_test
    async def test_prompt_tokens_details_say_the_cache_hits_and_whole_blocks_written(self) -> None:
        self.serve(prompt_tokens_details=True, content_tokens=1)
        shared = " ".join(f"w{i}" for i in range(40))
        first = json.loads(
            (await self.post("/v1/completions", completion(f"{shared} first"))).body_text()
        )
        second = json.loads(
            (await self.post("/v1/completions", completion(f"{shared} second"))).body_text()
        )
        # 41 tokens: two whole blocks written, then read back (the last block is never a hit)
        self.assertEqual(
            first["usage"]["prompt_tokens_details"],
            {"cached_tokens": 0, "created_cache_tokens": 32, "multimodal_tokens": None},
        )
        self.assertEqual(
            second["usage"]["prompt_tokens_details"],
            {"cached_tokens": 32, "created_cache_tokens": 0, "multimodal_tokens": None},
        )


class CompletionRefusals(StubCase):
    @async_test
    async def test_refusal_scenarios_answer_before_any_token_and_log_refused(self) -> None:
        self.serve()
        for word, status, kind in (
            ("overloaded", 503, "ServiceUnavailableError"),
            ("error500", 500, "InternalServerError"),
            ("error400", 400, "BadRequestError"),
        ):
            response = await self.post("/v1/completions", completion(f"please {word}", stream=True))
            self.assertEqual((response.status, self.error(response)["type"]), (status, kind))
        self.assertEqual(
            [fields for _, _, fields in self.log.events("refused")],
            [{"endpoint": "completions", "status": s} for s in (503, 500, 400)],
        )
        start = self.log.events("start")[0][2]
        self.assertEqual(
            (start["endpoint"], start["scenario"], start["stream"]),
            ("completions", "overloaded", True),
        )
        self.assertEqual(self.stub.stats.in_flight, 0)

    @async_test
    async def test_the_context_check_counts_the_default_16_output_tokens(self) -> None:
        self.serve(max_model_len=20)
        prompt = " ".join(["word"] * 10)
        refused = await self.post("/v1/completions", completion(prompt))
        self.assertEqual(refused.status, 400)
        self.assertEqual(
            self.error(refused)["message"],
            "This model's maximum context length is 20 tokens. However, you requested 16 output "
            "tokens and your prompt contains at least 5 input tokens, for a total of at least 21 "
            "tokens. Please reduce the length of the input prompt or the number of requested "
            "output tokens. (parameter=input_tokens, value=5)",
        )
        fits = await self.post("/v1/completions", completion(prompt, max_tokens=10))
        self.assertEqual(fits.status, 200)

    @async_test
    async def test_a_bad_body_or_model_is_refused_as_vllm_does_and_not_counted(self) -> None:
        self.serve(models=("m",))
        cases = [
            (completion(model="other"), 404, "The model `other` does not exist."),
            ({"model": "m"}, 400, "Either prompt or prompt_embeds must be provided and non-empty."),
            (completion(max_tokens=0), 400, "max_tokens must be at least 1, got 0."),
            (
                completion(stream_options={"include_usage": True}),
                400,
                "Stream options can only be defined when `stream=True`.",
            ),
        ]
        for body, status, message in cases:
            response = await self.post("/v1/completions", body)
            self.assertEqual((response.status, self.error(response)["message"]), (status, message))
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_hangup_reads_the_request_and_closes_without_an_answer(self) -> None:
        self.serve()
        response = await self.post("/v1/completions", completion("hangup"))
        self.assertEqual(response.raw, b"")
        self.assertEqual(self.stub.stats.hangups, 1)
        self.assertEqual(self.log.events("hangup")[0][2], {"endpoint": "completions"})


class Pacing(StubCase):
    """The clock decides: headers at once, a token after `hold`, one each `delay`."""

    @async_test
    async def test_a_stream_is_paced_like_chat_and_a_whole_answer_waits_for_hold(self) -> None:
        clock = Clock()
        self.serve(clock, hold=2.0, delay=0.5, content_tokens=2)
        stream = raw_request(self.port, "POST", "/v1/completions", completion(stream=True))
        await stream.until(lambda: b"\r\n\r\n" in stream.raw)
        self.assertEqual((stream.status, events(stream)), (200, []))  # nothing ran on the clock
        for seconds, count in ((2.0, 1), (0.5, 2), (0.5, 3), (0.5, 4)):
            clock.advance(seconds)
            await stream.until(lambda count=count: len(events(stream)) == count)
        self.assertEqual(events(stream)[-1], "[DONE]")
        await stream.closed
        self.assertEqual(len(self.log.events("complete")), 1)

        whole = raw_request(self.port, "POST", "/v1/completions", completion())
        await wait_for(lambda: self.stub.stats.in_flight == 1, what="the whole answer to start")
        self.assertEqual(whole.raw, b"")
        clock.advance(2.0)
        await whole.closed
        self.assertEqual(json.loads(whole.body_text())["choices"][0]["text"], "Hello! I ")
        self.assertEqual((self.stub.stats.in_flight, self.stub.stats.max_in_flight), (0, 1))

    @async_test
    async def test_a_client_that_leaves_is_cancelled_at_once(self) -> None:
        clock = Clock()
        self.serve(clock, hold=5.0)
        for path, body in (
            ("/v1/completions", completion(stream=True)),
            ("/v1/completions", completion()),
            ("/v1/embeddings", {"model": "m", "input": "hi"}),
        ):
            response = raw_request(self.port, "POST", path, body)
            await wait_for(lambda: self.stub.stats.in_flight == 1, what="the request to start")
            response.disconnect()
            await wait_for(lambda: self.stub.stats.in_flight == 0, what="the stub to see it go")
            self.assertEqual(clock.getDelayedCalls(), [])
        self.assertEqual(
            [fields["endpoint"] for _, _, fields in self.log.events("cancelled")],
            ["completions", "completions", "embeddings"],
        )
        self.assertEqual(self.stub.stats.cancelled, 3)

    @async_test
    async def test_in_flight_counts_every_endpoint(self) -> None:
        clock = Clock()
        self.serve(clock, hold=1.0)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        responses = [
            raw_request(self.port, "POST", path, body)
            for path, body in (
                ("/v1/chat/completions", chat),
                ("/v1/completions", completion()),
                ("/v1/embeddings", {"model": "m", "input": ["a", "b"]}),
            )
        ]
        await wait_for(lambda: self.stub.stats.in_flight == 3, what="all three to start")
        clock.advance(1.0)
        for response in responses:
            await response.closed
            self.assertEqual(response.status, 200)
        stats = self.stub.stats
        self.assertEqual((stats.requests, stats.in_flight, stats.max_in_flight), (3, 0, 3))
        self.assertEqual(stats.completed, 3)


def decode(blob: bytes, dtype: str, endianness: str) -> list[float]:
    """Undoes vLLM's tensor2binary for each embed_dtype, independently of the stub's code."""
    order = sys.byteorder if endianness == "native" else endianness
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    parts = [blob[i : i + width] for i in range(0, len(blob), width)]
    parts = [p if order == "big" else p[::-1] for p in parts]
    if dtype == "float32":
        return [struct.unpack(">f", p)[0] for p in parts]
    if dtype == "float16":
        return [struct.unpack(">e", p)[0] for p in parts]
    if dtype == "bfloat16":
        return [struct.unpack(">f", p + b"\0\0")[0] for p in parts]
    if dtype == "fp8_e5m2":
        return [struct.unpack(">e", p + b"\0")[0] for p in parts]
    values = []
    for (b,) in parts:  # fp8_e4m3fn, normal numbers: bias 7, 3 fraction bits
        sign = -1 if b & 0x80 else 1
        values.append(sign * (1 + (b & 7) / 8) * 2.0 ** ((b >> 3 & 15) - 7))
    return values


def embed(inputs: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "input": inputs, **extra}


class Embeddings(StubCase):
    async def vectors(self, inputs: Any, **extra: Any) -> list[list[float]]:
        answer = json.loads((await self.post("/v1/embeddings", embed(inputs, **extra))).body_text())
        return [item["embedding"] for item in answer["data"]]

    @async_test
    async def test_float_is_vllms_embedding_list_with_deterministic_vectors(self) -> None:
        self.serve()
        response = await self.post("/v1/embeddings", embed(["one two", "three"]))
        self.assertEqual(response.header("content-type"), "application/json")
        answer = json.loads(response.body_text())
        first, second = (item["embedding"] for item in answer["data"])
        self.assertEqual(
            answer,
            {
                "id": "embd-1",
                "object": "list",
                "created": answer["created"],
                "model": "m",
                "data": [
                    {"index": 0, "object": "embedding", "embedding": first},
                    {"index": 1, "object": "embedding", "embedding": second},
                ],
                "usage": {
                    "prompt_tokens": 3,
                    "total_tokens": 3,
                    "completion_tokens": 0,
                    "prompt_tokens_details": None,
                    "completion_tokens_details": None,
                },
            },
        )
        self.assertEqual((len(first), len(second)), (8, 8))
        self.assertNotEqual(first, second)
        self.assertEqual(await self.vectors("one two"), [first])  # the same input, the same vector
        self.assertEqual(await self.vectors([[1, 2, 3]]), await self.vectors([1, 2, 3]))
        self.assertEqual(
            self.log.events("complete")[0][2],
            {"endpoint": "embeddings", "finish": None, "tokens": 0},
        )

    @async_test
    async def test_dimensions_slice_a_matryoshka_vector_and_are_refused_otherwise(self) -> None:
        self.serve(embedding_size=64)
        (full,) = await self.vectors("text")
        (short,) = await self.vectors("text", dimensions=5)
        self.assertEqual((len(full), short), (64, full[:5]))
        self.assertEqual(await self.vectors("text", dimensions=1000), [full])
        zero = await self.post("/v1/embeddings", embed("text", dimensions=0))
        self.assertEqual(self.error(zero)["message"], "Dimensions must be greater than 0")

        self.serve(matryoshka=False)
        refused = await self.post("/v1/embeddings", embed("text", dimensions=4))
        self.assertEqual(refused.status, 400)
        self.assertEqual(
            self.error(refused)["message"],
            'Model "m" does not support matryoshka representation, changing output dimensions '
            "will lead to poor results.",
        )

    @async_test
    async def test_base64_holds_the_same_values_in_every_dtype_and_byte_order(self) -> None:
        self.serve()
        (floats,) = await self.vectors("text")
        for dtype in ("float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"):
            for endianness in ("native", "big", "little"):
                body = embed(
                    "text", encoding_format="base64", embed_dtype=dtype, endianness=endianness
                )
                answer = json.loads((await self.post("/v1/embeddings", body)).body_text())
                blob = base64.b64decode(answer["data"][0]["embedding"])
                self.assertEqual(decode(blob, dtype, endianness), floats, (dtype, endianness))

    @async_test
    async def test_bytes_are_the_vectors_back_to_back_with_a_metadata_header(self) -> None:
        self.serve()
        floats = await self.vectors(["one two", "three"])
        body = embed(
            ["one two", "three"], encoding_format="bytes", embed_dtype="float16", endianness="big"
        )
        response = await self.post("/v1/embeddings", body)
        self.assertEqual(response.header("content-type"), "application/octet-stream")
        blob = response.body_bytes()
        self.assertEqual(
            [decode(blob[:16], "float16", "big"), decode(blob[16:], "float16", "big")], floats
        )
        metadata = response.header("metadata")
        assert metadata is not None
        item = {"embed_dtype": "float16", "endianness": "big"}
        self.assertEqual(
            metadata,
            json.dumps(  # vLLM's json.dumps, default separators
                {
                    "id": "embd-2",
                    "created": json.loads(metadata)["created"],
                    "model": "m",
                    "data": [
                        {"index": 0, **item, "start": 0, "end": 16, "shape": [8]},
                        {"index": 1, **item, "start": 16, "end": 32, "shape": [8]},
                    ],
                    "usage": {"prompt_tokens": 3, "total_tokens": 3},
                }
            ),
        )
        only = await self.post("/v1/embeddings", embed("three", encoding_format="bytes_only"))
        self.assertIsNone(only.header("metadata"))
        self.assertEqual(decode(only.body_bytes(), "float32", "native"), floats[1])

    @async_test
    async def test_scenarios_refusals_and_the_context_check(self) -> None:
        self.serve(max_model_len=4)
        for word, status in (
            ("overloaded", 503),
            ("error500", 500),
            ("error400", 400),
            ("fail", 500),
        ):
            response = await self.post("/v1/embeddings", embed(["fine", f"now {word}"]))
            self.assertEqual(response.status, status, word)
        self.assertEqual(self.error(response)["message"], "stub: the engine died")
        hangup = await self.post("/v1/embeddings", embed("hangup"))
        self.assertEqual(hangup.raw, b"")
        long = await self.post("/v1/embeddings", embed("a b c d e"))
        self.assertEqual(
            self.error(long)["message"],
            "This model's maximum context length is 4 tokens. However, you requested 0 output "
            "tokens and your prompt contains at least 5 input tokens, for a total of at least 5 "
            "tokens. Please reduce the length of the input prompt or the number of requested "
            "output tokens. (parameter=input_tokens, value=5)",
        )
        self.assertEqual({fields["endpoint"] for _, _, fields in self.log.lines}, {"embeddings"})

    @async_test
    async def test_a_bad_body_is_refused_with_pydantics_wording(self) -> None:
        self.serve()
        for body, message in (
            ({"model": "m"}, "input: Field required"),
            (embed(7), "input: Input should be a valid string"),
            (
                embed("x", encoding_format="int8"),
                "encoding_format: Input should be 'float', 'base64', 'bytes' or 'bytes_only'",
            ),
            (
                embed("x", endianness="middle"),
                "endianness: Input should be 'native', 'big' or 'little'",
            ),
        ):
            response = await self.post("/v1/embeddings", body)
            self.assertEqual((response.status, self.error(response)["message"]), (400, message))


class ChatCacheWrites(StubCase):
    @async_test
    async def test_chat_usage_says_created_cache_tokens_in_stream_and_whole(self) -> None:
        self.serve(prompt_tokens_details=True, reasoning_tokens=0, content_tokens=1)
        shared = " ".join(f"w{i}" for i in range(39))

        def chat(last: str, stream: bool) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": "m",
                "stream": stream,
                "messages": [{"role": "user", "content": f"{shared} {last}"}],
            }
            if stream:
                body["stream_options"] = {"include_usage": True}
            return body

        first = events(await self.post("/v1/chat/completions", chat("one", True)))
        # 44 tokens (40 words, 4 for the message): two whole blocks written, none read
        self.assertEqual(
            first[-2]["usage"]["prompt_tokens_details"],
            {"cached_tokens": 0, "created_cache_tokens": 32},
        )
        second = await self.post("/v1/chat/completions", chat("two", False))
        self.assertEqual(
            json.loads(second.body_text())["usage"]["prompt_tokens_details"],
            {"cached_tokens": 32, "created_cache_tokens": 0},
        )
