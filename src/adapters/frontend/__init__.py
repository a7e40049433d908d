"""The public API's front end: everything a client sees is made here, from the token ids a
`Backend` yields (the local engine on a single node, prefill and decode peers on the router), so
the output through the cluster is byte-identical to a single node's.

By idea, each module's first paragraph says more:

| module | what |
| --- | --- |
| `intake` | refusing any request: strict bodies, `Reject`, validation errors, error answers |
| `openai_bodies`, `messages_bodies`, `responses_bodies` | each API's request models and validation |
| `prompts` | the tokenizer's side: prompts, the chat template, tools, forced calls |
| `generation` | the generation driver every API shares: tokens in, text steps out |
| `frontend` | `Job` (a body as the job it asks for); `Frontend`: reading a request, `prepare`, `start` |
| `chat_run` | one choice of a chat as the APIs served as a chat start and read it |
| `openai_api` | OpenAI's routes and answers (chat, completions, models, health) |
| `tokenize_api` | vLLM's `/tokenize` and `/detokenize` |
| `as_chat`, `messages_api`, `responses_api` | Messages' and Responses' answers and routes |
| `app` | `build_app`: every route, API keys and CORS in one ASGI app |

Imports run down that table's dependencies, never back: the API modules import `frontend`,
which imports none of them, and only `app` knows every API. Server-sent events' framing and the
stream response are `adapters.http.streaming`'s (the node API and the live view stream through
it too). May import anything; nothing in `statecore` or `effects` may import this package.
"""

# The package's modules (import them by name: nothing is re-exported here, so importing the
# package stays free).
__all__ = [
    "app",
    "as_chat",
    "chat_run",
    "frontend",
    "generation",
    "intake",
    "messages_api",
    "messages_bodies",
    "openai_api",
    "openai_bodies",
    "prompts",
    "responses_api",
    "responses_bodies",
    "tokenize_api",
]
