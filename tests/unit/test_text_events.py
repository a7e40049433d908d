"""A streamed text chunk made from its template is byte for byte the chunk rendered as JSON.

The front end renders a choice's text chunk once, with a stand-in text, and splices each real
text into it escaped the way `json.dumps` escapes a string. Whatever the text (quotes,
backslashes, control characters, line breaks JSON must escape, non-ASCII, lone surrogates) and
whatever the response's head (model names included), the bytes are the ones the plain rendering
gives, or both ways fail alike.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from adapters.frontend.frontend import Frontend, Job, Kind
from adapters.frontend.openai_api import chunk, text_event
from adapters.http.streaming import TEXT_MARK, TextEvent, data_event
from effects.ports import SamplingParams
from statecore.ids import RequestId
from tests.integration.fake_backend import FakeBackend

_ESCAPED = "\"\\/\b\f\n\r\t\x00\x1f\x7f\u2028\u2029é日本😀"  # what JSON escapes, and some it need not
_CHARS = st.one_of(st.characters(), st.sampled_from(_ESCAPED))  # st.characters(): no surrogates
# half the time with lone surrogates (category Cs), which UTF-8 refuses
_ANY_TEXT = st.one_of(
    st.text(_CHARS, max_size=40),
    st.text(st.one_of(_CHARS, st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)), max_size=40),
)


def _job(kind: Kind, include_usage: bool) -> Job:
    return Job(kind=kind, request_id=RequestId("r-1"), created=1_700_000_000, prompt=(1, 2),
                sampling=SamplingParams(max_tokens=4), stops=(), stream=True,
                include_usage=include_usage)


def _rendered(frontend: Frontend, job: Job, text: str, index: int) -> bytes | type[Exception]:
    try:
        return data_event(chunk(job, frontend.model_name, text, index=index))
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8
        return UnicodeEncodeError


def _templated(frontend: Frontend, job: Job, text: str, index: int) -> bytes | type[Exception]:
    try:
        return text_event(job, frontend.model_name, index)(text)
    except UnicodeEncodeError:
        return UnicodeEncodeError


@given(text=_ANY_TEXT, model=_ANY_TEXT, kind=st.sampled_from(Kind), include_usage=st.booleans(),
       index=st.integers(0, 15))
@example(text=_ESCAPED + "\ud800", model="tiny", kind=Kind.CHAT, include_usage=False, index=0)
@example(text=TEXT_MARK, model=TEXT_MARK, kind=Kind.COMPLETION, include_usage=True, index=3)
@example(text="", model="m\"\\", kind=Kind.CHAT, include_usage=True, index=1)
def test_a_templated_text_event_is_the_rendered_one(
    text: str, model: str, kind: Kind, include_usage: bool, index: int
) -> None:
    frontend = Frontend(None, FakeBackend(), model_name=model)
    job = _job(kind, include_usage)
    assert _templated(frontend, job, text, index) == _rendered(frontend, job, text, index)


def test_the_common_case_has_a_template_and_a_clash_falls_back() -> None:
    job = _job(Kind.CHAT, False)
    plain = Frontend(None, FakeBackend(), model_name="tiny")
    assert TextEvent.around(data_event(chunk(job, plain.model_name, TEXT_MARK))) is not None
    clash = Frontend(None, FakeBackend(), model_name=TEXT_MARK)  # the mark twice: no template
    assert TextEvent.around(data_event(chunk(job, clash.model_name, TEXT_MARK))) is None
    assert text_event(job, clash.model_name, 0)("hi") == data_event(chunk(job, clash.model_name, "hi"))
