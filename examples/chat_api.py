"""Structured output and a tool-call round trip through the OpenAI client, against a running
scripts/serve.py (the shipped base model needs `--chat-template examples/qwen3-chat-template.jinja`).

    python examples/chat_api.py [--url http://127.0.0.1:8000/v1]

Greedy, thinking off: the same server gives the same output every time.
"""

import argparse
import json

import openai

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
MODULE = {"type": "object", "required": ["name", "functions"], "properties": {
    "name": {"type": "string", "maxLength": 16},
    "functions": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    args = p.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="none", max_retries=0)
    try:
        model = client.models.list().data[0].id
    except openai.APIConnectionError:
        raise SystemExit(f"chat_api.py: error: no server answers at {args.url}: start one first "
                         "(python scripts/serve.py --chat-template examples/qwen3-chat-template.jinja)") from None
    thinking_off = {"chat_template_kwargs": {"enable_thinking": False}}
    common = dict(model=model, temperature=0, max_tokens=60, extra_body=thinking_off)

    # A JSON schema: the reply is a JSON document of it, whatever the model would have written.
    reply = client.chat.completions.create(
        messages=[{"role": "user", "content": "Describe the os module as JSON"}],
        response_format={"type": "json_schema", "json_schema": {"name": "module", "schema": MODULE}}, **common)
    print("JSON:", json.loads(reply.choices[0].message.content))

    # A tool call round trip: the call (forced here), the tool's result sent back, the answer.
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(messages=messages, tools=[WEATHER], **common,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = reply.choices[0].message.tool_calls[0]
    print("call:", call.function.name, call.function.arguments, "finish_reason:", reply.choices[0].finish_reason)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 18, "sky": "clear"})}]
    reply = client.chat.completions.create(messages=messages, tools=[WEATHER], **common)
    print("answer:", repr(reply.choices[0].message.content))


if __name__ == "__main__":
    main()
