"""Builds tests/fixtures/xtml/goldens.json: XTML segments for varied chat requests, rendered by
Moonshot's reference encoder (encoding_k3.py from Kimi K3's Hugging Face code, pinned in
../shared/docs/K3-ARCHITECTURE.md §0 [HF]). The reference file is not part of this repository:
fetch it into the ignored third_party_ref/ folder and pass its path.

    python3 tests/tools/make_xtml_goldens.py third_party_ref/kimi_k3/encoding_k3.py

Like ../shared/fixtures/xtml-chat/goldens.json, the request is under "input" (OpenAI-style body plus
K3's thinking / thinking_effort / add_generation_prompt) and the reference's build_chat_segments()
output is under "segments"; requests the reference rejects are under "errors" (message only).
Then tests/tools/add_xtml_ids.mjs adds the token ids per case with the reference tiktoken.
"""
import importlib.util
import json
import sys

spec = importlib.util.spec_from_file_location("encoding_k3", sys.argv[1])
enc = importlib.util.module_from_spec(spec)
sys.modules["encoding_k3"] = enc  # dataclasses look their module up there
spec.loader.exec_module(enc)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "required": ["city"],
                          "properties": {"units": {"enum": ["c", "f"], "type": "string"}, "city": {"type": "string"}}}}}
SEARCH = {"function": {"name": "search", "parameters": {"properties": {"q": {"type": "string", "description": "Query «é»"},
                       "k": {"type": "integer", "default": 5}}, "type": "object"}, "description": "Web search"},
          "type": "function"}

def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}

cases = {
    "no_thinking_history": {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "easy"},
        {"role": "user", "content": "and 3+3?"}], "thinking": False},
    "effort_high_and_max": {"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "high"},
    "effort_max": {"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "max"},
    "effort_ignored_without_thinking": {"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "max",
                                        "thinking": False},
    "tool_choice_none": {"tools": [WEATHER], "messages": [{"role": "user", "content": "no tools please"}],
                         "tool_choice": "none"},
    "tool_choice_auto_and_named": {"tools": [WEATHER, SEARCH], "messages": [{"role": "user", "content": "x"}],
                                   "tool_choice": "auto"},
    "json_schema": {"messages": [{"role": "user", "content": "a person"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": {
            "type": "object", "required": ["name", "age"],
            "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}}}}}},
    "json_schema_without_schema_key": {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"type": "object", "properties": {"b": {}, "a": {}}}}},
    "typed_arguments": {"tools": [SEARCH], "messages": [
        {"role": "user", "content": "typed"},
        {"role": "assistant", "content": None, "reasoning_content": "  calling  ", "tool_calls": [call("c1", "search", json.dumps({
            "q": "say \"hi\" & <|open|>", "k": 3, "ratio": 0.1, "big": 1e20, "tiny": 1.5e-7, "neg": -0.0, "int_float": 2.0,
            "flag": True, "off": False, "nothing": None, "obj": {"z": 1, "a": [1, 2, {"y": "ü"}], "m": {}},
            "arr": [1, "two", None, 3.25], "empty": "", "ctrl": "tab\there\u0001", "nested_empty": []},
            ensure_ascii=False))]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok <|end_of_msg|> [EOS]"}]},
    "arguments_not_json_and_empty": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            call("a", "f", "{not json"), call("b", "g", "   "), call("c", "h", {"dict": "given directly"}),
            {"id": "d", "function": {"name": "i"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
        {"role": "tool", "tool_call_id": "c", "content": "3"},
        {"role": "tool", "tool_call_id": "d", "content": "4"}]},
    "attribute_escaping": {"messages": [
        {"role": "user", "name": "Tom \"T&J\" <x>", "content": "hello"},
        {"role": "assistant", "content": "", "tool_calls": [call("q", "we\"ird&name", "{\"k&\\\"ey\": 1}")]},
        {"role": "tool", "tool_call_id": "q", "content": "done"}]},
    "tool_results_unmatched_run_kept": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call("1", "f", "{}"), call("2", "g", "{}")]},
        {"role": "tool", "tool_call_id": "2", "name": "g", "content": "second"},
        {"role": "tool", "tool_call_id": "zzz", "name": "f", "content": "first"}]},
    "tool_results_reordered_and_renamed": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call("1", "f", "{}"), call("2", "g", "{}"), call("3", "h", "{}")]},
        {"role": "tool", "tool_call_id": "3", "name": "stale", "content": "c"},
        {"role": "tool", "tool_call_id": "1", "content": "a"},
        {"role": "tool", "tool_call_id": "2", "tool": "stale2", "content": "b"},
        {"role": "user", "content": "next"},
        {"role": "tool", "tool_call_id": "2", "content": "late"}]},
    "tool_names_by_position": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
            {"type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "content": "A"},
        {"role": "tool", "content": "B"}]},
    "content_parts_and_images": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": ""}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a picture"}]}], "add_generation_prompt": False},
    "system_named_and_dynamic_tools": {"messages": [
        {"role": "system", "name": "ops", "content": "Be safe."},
        {"role": "system", "content": "ignored when tools are present", "tools": [SEARCH]},
        {"role": "user", "name": "", "content": "q"}], "tools": [WEATHER]},
    "reasoning_fallback_key": {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "reasoning_content": "", "reasoning": "from the other key", "content": "y"},
        {"role": "assistant", "reasoning_content": " \n\t ", "content": "z"},
        {"role": "user", "content": "w"}]},
    "multi_turn_tools": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "reasoning_content": "r1", "content": "", "tool_calls": [call("x", "get_weather", "{\"city\":\"Paris\"}")]},
        {"role": "tool", "tool_call_id": "x", "content": "{\"t\":1}"},
        {"role": "assistant", "reasoning_content": "r2", "content": "It is 1°C."},
        {"role": "user", "content": "And Rome?\r\n  "},
        {"role": "assistant", "content": "", "tool_calls": [call("y", "get_weather", "{\"city\":\"Rome\",\"units\":\"f\"}")]},
        {"role": "tool", "tool_call_id": "y", "content": ""}], "thinking_effort": "low", "tool_choice": "required",
        "response_format": {"type": "json_object"}},
    "whitespace_and_unicode": {"messages": [
        {"role": "user", "content": "  lead\n\n\ntrail   \t"},
        {"role": "assistant", "content": "中文，标点 👨‍👩‍👧 e\u0301", "reasoning_content": "思考"}], "add_generation_prompt": True,
        "thinking": True},
    "empty_messages": {"messages": []},
    "response_format_text": {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"}},
}

error_cases = {
    "effort_medium": {"messages": [{"role": "user", "content": "hi"}], "thinking_effort": "medium"},
    "arguments_not_object": {"messages": [{"role": "assistant", "content": "", "tool_calls": [call("a", "f", "[1,2]")]}]},
    "tool_without_name": {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"}]},
}

def render(req):
    kwargs = {k: v for k, v in req.items() if k not in ("messages", "tools", "thinking", "add_generation_prompt")}
    segs = enc.build_chat_segments(req["messages"], tools=req.get("tools"),
                                   add_generation_prompt=req.get("add_generation_prompt", True),
                                   thinking=req.get("thinking", True), **kwargs)
    return [{"text": s.text, "special": s.allow_special} for s in segs]

out = {"note": "Segments from Moonshot's reference K3 XTML encoder (encoding_k3.py build_chat_segments) for the "
               "requests under input; made by tests/tools/make_xtml_goldens.py.", "cases": {}, "errors": {}}
for name, req in cases.items():
    out["cases"][name] = {"input": req, "segments": render(req)}
for name, req in error_cases.items():
    try:
        render(req)
    except Exception as e:  # noqa: BLE001 - any rejection counts
        out["errors"][name] = {"input": req, "error": f"{type(e).__name__}: {e}"}
    else:
        raise SystemExit(f"{name}: the reference accepted it")
json.dump(out, open("tests/fixtures/xtml/goldens.json", "w"), ensure_ascii=False, indent=1)
print(len(out["cases"]), "cases,", len(out["errors"]), "errors")
