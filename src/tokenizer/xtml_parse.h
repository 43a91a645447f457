// XTML, the other way: generated token ids (or rendered text) back into the assistant's think text,
// response text and structured tool calls.
//
// The generation prompt leaves the model inside the think channel (or the response channel when
// not thinking); it then writes `...<|close|>think<|sep|><|open|>response<|sep|>...<|close|>response
// <|sep|>[<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>argument key="K"
// type="T"<|sep|>VALUE<|close|>argument<|sep|>...<|close|>call<|sep|>...<|close|>tools<|sep|>]
// <|close|>message<|sep|><|end_of_msg|>`. Parsing works on the ids, where control tokens are
// special ids, so a literal "<|open|>" inside generated text stays text.
//
// Generated output is untrusted: it may stop anywhere (max tokens) or be malformed. The parser
// never throws on content; it keeps everything it can (a truncated call is returned with
// complete = false, a truncated argument keeps its partial text) and notes what it skipped in
// `warnings`.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace k3 {

class Tokenizer;

enum class XtmlPieceKind { kText, kOpen, kClose, kSep, kEndOfMsg, kOtherSpecial };

struct XtmlPiece {
  XtmlPieceKind kind = XtmlPieceKind::kText;
  std::string text;  // the bytes of a text run, or the special token's text
};

// Ids -> pieces: each structural special id is one piece; consecutive ordinary ids are decoded
// together (so multi-byte characters split across ids come out whole).
std::vector<XtmlPiece> xtml_pieces_from_ids(const Tokenizer& tok, const std::vector<int32_t>& ids);
// Rendered text -> pieces, recognising the control tokens by their text.
std::vector<XtmlPiece> xtml_pieces_from_text(std::string_view text);

// Where the parse starts: after the generation prompt's `<|open|>think<|sep|>` (kThink) or
// `<|open|>response<|sep|>` (kResponse), or right after `<|open|>message role="assistant"<|sep|>`.
enum class XtmlStart { kThink, kResponse, kMessageBody };

struct XtmlToolCall {
  std::string name;
  int64_t index = 0;                                                    // 1-based, as rendered
  nlohmann::ordered_json arguments = nlohmann::ordered_json::object();  // typed values
  std::optional<std::string> raw_arguments;                             // a `json` block that was not parsed
  bool complete = false;                                                // saw <|close|>call<|sep|>
};

struct XtmlAssistantMessage {
  std::string think, response;
  bool has_think = false;
  std::vector<XtmlToolCall> tool_calls;
  bool complete = false;  // saw <|close|>message<|sep|> or <|end_of_msg|>
  std::vector<std::string> warnings;

  // {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?: [{"id", "type": "function",
  // "function": {"name", "arguments": JSON string}}]} as an OpenAI-style chat response message.
  nlohmann::ordered_json to_openai() const;
};

XtmlAssistantMessage parse_assistant(const std::vector<XtmlPiece>& pieces, XtmlStart start);

}  // namespace k3
