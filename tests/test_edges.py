"""What a hostile client or a careless operator found at the edges: numbers that are not
JSON, model names that are not labels, paths and headers the router never expected, and
connections that never say anything."""

from __future__ import annotations

import json

from tests.helpers import chat
from tests.test_llm import LLMSurface
from tests.test_proxy import async_test


class NonFiniteNumbers(LLMSurface):
    @async_test
    async def test_a_number_that_overflows_to_infinity_is_refused(self) -> None:
        for field in ('"temperature": 1e400', '"top_p": -1E+999'):
            body = json.dumps(chat())[:-1] + f", {field}}}"
            message = await self.error(body.encode(), 400, "invalid_request_error")
            self.assertIn(field.split(": ")[1], message)
        self.assertEqual(self.stub.stats.requests, 0)

    @async_test
    async def test_the_same_inside_count_tokens(self) -> None:
        body = json.dumps(chat(stream=False))[:-1] + ', "temperature": 1e400}'
        response = await self.post(body.encode(), "/llm/v1/messages/count_tokens")
        self.assertEqual(response.status, 400, response.body_text())
        self.assertIn("1e400", json.loads(response.body_text())["error"]["message"])
