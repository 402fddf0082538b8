"""Popular clients, unchanged, against an OpenAI-compatible server (llmpipe or `vllm serve`):
the `openai` client with vLLM's sampling fields, tools and structured outputs, LangChain's
``bind_tools`` and instructor's default (tools) mode. One line per call; exit 1 if any failed.

    pip install openai langchain-openai instructor     # a venv of the client's own
    python scripts/client_check.py http://127.0.0.1:8000 smollm2

docs/api.md ("vLLM's request fields") gives a measured run against both servers."""
import json
import sys

from openai import OpenAI

base = sys.argv[1]
model = sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="x")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
results = []


def check(name, fn):
    try:
        out = fn()
        results.append((name, "ok", out))
    except Exception as exc:
        results.append((name, "FAIL", f"{type(exc).__name__}: {str(exc)[:300]}"))


def penalties():
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=8, presence_penalty=0.5,
                                       frequency_penalty=0.5, extra_body={"top_k": 5, "min_p": 0.1,
                                                                          "repetition_penalty": 1.1})
    return r.choices[0].finish_reason


def tools_auto():
    r = client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=32)
    return r.choices[0].finish_reason


def tools_required():
    r = client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=128)
    calls = r.choices[0].message.tool_calls
    if not calls:
        raise RuntimeError(f"no tool call; finish_reason {r.choices[0].finish_reason}: {r.choices[0].message.content!r}")
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def tools_named():
    r = client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, max_tokens=128,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    if not calls:
        raise RuntimeError(f"no tool call; finish_reason {r.choices[0].finish_reason}: {r.choices[0].message.content!r}")
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def tools_stream():
    s = client.chat.completions.create(model=model, messages=MSG, tools=TOOLS, max_tokens=128, stream=True,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    names, args = [], ""
    for ch in s:
        for tc in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                args += tc.function.arguments
    return names, json.loads(args)


def structured():
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=16,
                                       extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    return r.choices[0].message.content


def json_schema():
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=128, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": TOOLS[0]["function"]["parameters"]}})
    return json.loads(r.choices[0].message.content)


def langchain():
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=f"{base}/v1", api_key="x", model=model, max_tokens=128)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    auto = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
    return forced.tool_calls, type(auto).__name__


def instructor_tools():
    import instructor
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str

    ic = instructor.from_openai(OpenAI(base_url=f"{base}/v1", api_key="x"))  # default mode: TOOLS
    w = ic.chat.completions.create(model=model, response_model=Weather, messages=MSG, max_tokens=128, max_retries=0)
    return w.model_dump()


for name, fn in [("penalties+top_k", penalties), ("tools auto", tools_auto), ("tools required", tools_required),
                 ("tools named", tools_named), ("tools named streamed", tools_stream),
                 ("structured_outputs choice", structured), ("response_format json_schema", json_schema),
                 ("langchain bind_tools", langchain), ("instructor TOOLS", instructor_tools)]:
    check(name, fn)
for r in results:
    print(" | ".join(map(str, r)))
sys.exit(1 if any(r[1] == "FAIL" for r in results) else 0)
