"""Every sampling parameter crosses the internal wire (router -> prefill -> decode) unchanged:
a field the wire dropped would make the decode node sample differently from a single node."""

from __future__ import annotations

from dataclasses import fields

from adapters.internal_wire import SamplingBody
from effects.engine_port import SamplingParams


def test_every_sampling_field_crosses_the_wire_with_its_value() -> None:
    sampling = SamplingParams(max_tokens=9, temperature=0.3, top_p=0.8, top_k=5, seed=2**63 + 1,
                              ignore_eos=True, min_p=0.2, xtc_probability=0.5, xtc_threshold=0.2,
                              xtc_special_tokens=(1, 13), logit_bias=((1, -2.5), (40, 3.0)),
                              repetition_penalty=1.1,
                              repetition_context_size=7, presence_penalty=-0.4, presence_context_size=3,
                              frequency_penalty=0.9, frequency_context_size=64, logprobs=3,
                              response_format='{"type":"json_object"}', choice_group="r", choice=1,
                              choices=3)
    defaults = SamplingParams(max_tokens=1)
    assert all(getattr(sampling, f.name) != getattr(defaults, f.name) for f in fields(SamplingParams))
    assert set(SamplingBody.model_fields) == {f.name for f in fields(SamplingParams)}
    crossed = SamplingBody.model_validate_json(SamplingBody.of(sampling).model_dump_json()).params()
    assert crossed == sampling
