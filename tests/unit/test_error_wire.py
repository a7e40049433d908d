"""A node's error document on the internal wire: the node an error comes from crosses it beside
the body, so that a reader that knows no origin (an older node) still reads the error, and a
document without one reads as not known."""

from __future__ import annotations

import json

from adapters.http.internal_wire import ErrorBody, error_from_json, error_json, output_line, parse_output_line
from statecore.errors import Code, ErrorInfo, Fault
from statecore.ids import RequestId
from statecore.intents import Reject

LOST = ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST, "lost the KV stream", origin="http://prefill:8001")


def test_an_errors_origin_crosses_the_wire_and_an_older_reader_reads_the_rest() -> None:
    document = json.loads(json.dumps(error_json(LOST)))
    assert error_from_json(document, 502) == LOST
    # what a reader that knows no origin validates: the body alone, strict as ever
    assert ErrorBody.model_validate(document["error"]).code == "transport_lost"
    # a decode node's stream line carries it too
    line = output_line(Reject(RequestId("r"), LOST))
    assert parse_output_line(line) == LOST


def test_a_document_without_an_origin_reads_as_not_known() -> None:
    unknown = ErrorInfo(Fault.PEER, Code.KV_NOT_FOUND, "gone")
    document = error_json(unknown)
    assert "origin" not in document
    assert error_from_json(document, 404).origin is None
    assert error_from_json({**document, "origin": 7}, 404) == unknown  # not a node's name: not known


def test_an_error_that_names_its_origin_keeps_it_as_it_is_passed_on() -> None:
    assert LOST.came_from("http://decode:8002") == LOST
    made_here = ErrorInfo(Fault.BUG, Code.INTERNAL, "oops")
    assert made_here.came_from("http://decode:8002").origin == "http://decode:8002"
