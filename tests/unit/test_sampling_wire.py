"""Every sampling parameter crosses the internal wire (router -> prefill -> decode) unchanged:
a field the wire dropped would make the decode node sample differently from a single node."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
from pydantic import ValidationError

from adapters.http.internal_wire import DecodeBody, PrefillBody, SamplingBody
from effects.engine_port import SamplingParams


def test_every_sampling_field_crosses_the_wire_with_its_value() -> None:
    sampling = SamplingParams(max_tokens=9, temperature=0.3, top_p=0.8, top_k=5, seed=2**63 + 1,
                              ignore_eos=True, min_p=0.2, xtc_probability=0.5, xtc_threshold=0.2,
                              xtc_special_tokens=(1, 13), logit_bias=((1, -2.5), (40, 3.0)),
                              repetition_penalty=1.1,
                              repetition_context_size=7, presence_penalty=-0.4, presence_context_size=3,
                              frequency_penalty=0.9, frequency_context_size=64, logprobs=3,
                              response_format='{"type":"json_object"}', choice_group="r", choice=1,
                              choices=3, adapter="x", num_draft_tokens=2)
    defaults = SamplingParams(max_tokens=1)
    assert all(getattr(sampling, f.name) != getattr(defaults, f.name) for f in fields(SamplingParams))
    assert set(SamplingBody.model_fields) == {f.name for f in fields(SamplingParams)}
    crossed = SamplingBody.model_validate_json(SamplingBody.of(sampling).model_dump_json()).params()
    assert crossed == sampling
    # a body names its adapter and its draft count only when there are: an older node sees the
    # body it knows
    for adapter, drafts in ((None, None), ("x", 0)):
        sampling_body = SamplingBody.of(SamplingParams(1, adapter=adapter, num_draft_tokens=drafts))
        body = PrefillBody(request_id="r", prompt=[1], sampling=sampling_body)
        sent = json.loads(body.encoded())["sampling"]
        assert isinstance(sent, dict) and sent.get("adapter", "absent") == (adapter or "absent")
        assert sent.get("num_draft_tokens", "absent") == ("absent" if drafts is None else drafts)
        crossed_body = PrefillBody.model_validate_json(body.encoded()).sampling
        assert (crossed_body.adapter, crossed_body.num_draft_tokens) == (adapter, drafts)


def test_internal_messages_are_strict() -> None:
    """No coercion on the internal wire: a string or a fraction where an int belongs is refused,
    as is a field the model does not know."""
    ok = '{"request_id": "r", "prompt": [1, 2], "sampling": {"max_tokens": 3, "temperature": 1}}'
    assert PrefillBody.model_validate_json(ok).sampling.temperature == 1.0
    for bad in ('{"request_id": "r", "prompt": ["1"], "sampling": {"max_tokens": 3}}',
                '{"request_id": "r", "prompt": [1], "sampling": {"max_tokens": 3.0}}',
                '{"request_id": "r", "prompt": [1], "sampling": {"max_tokens": 3}, "extra": 1}'):
        with pytest.raises(ValidationError):
            PrefillBody.model_validate_json(bad)


def test_prompt_bodies_send_optional_fields_only_when_set() -> None:
    """A node of an older version refuses unknown fields: a body the router writes without a
    handoff hint names none of them, and one built unvalidated (as the router builds it) encodes
    as a validated one."""
    sampling = SamplingBody.of(SamplingParams(4))
    plain = PrefillBody.model_construct(request_id="r", prompt=[1, 2], sampling=sampling)
    assert json.loads(plain.encoded()) == {"request_id": "r", "prompt": [1, 2],
                                           "sampling": json.loads(sampling.model_dump_json(
                                               exclude={"adapter", "num_draft_tokens"}))}
    attached = PrefillBody.model_construct(request_id="r", prompt=[1, 2], sampling=sampling, kv_attach=True,
                                           kv_attach_by="http://d:1")
    assert attached.encoded() == PrefillBody.model_validate_json(attached.encoded()).encoded()
    assert {"kv_attach", "kv_attach_by"} <= json.loads(attached.encoded()).keys()
    decode = DecodeBody.model_construct(request_id="r", prompt=[3], sampling=sampling, first_token=7)
    assert set(json.loads(decode.encoded())) == {"request_id", "prompt", "sampling", "first_token",
                                                 "prefill_url"}
    assert DecodeBody.model_validate_json(decode.encoded()).first_token == 7
