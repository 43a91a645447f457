// XTML, Kimi K3's chat format (K3-ARCHITECTURE.md §9): rendering a chat request into segments.
//
// An element is `<|open|>tag key="value"<|sep|> ... <|close|>tag<|sep|>` and a message ends with
// `<|end_of_msg|>`. The reference encoder (Moonshot's encoding_k3.py) does not tokenise the rendered
// string: it tokenises each *segment* on its own and concatenates the ids. Segments are the control
// tokens (special), and the tag name, `" key"`, `'="'`, the attribute value, `'"'` and each text
// body (ordinary text, special tokens disabled). BPE never merges across a segment boundary, so
// the ids differ from encoding the whole string, and a user typing `<|open|>` gets plain BPE, not
// the control token. render_chat() reproduces that segment list; encode_segments() the ids.
//
// The request is an OpenAI-style chat body: `messages` (system / user / assistant / tool, content
// as a string or a list of parts; assistant `tool_calls` whose `function.arguments` are JSON
// strings; `reasoning_content` for the think channel), `tools`, `tool_choice` ("required"/"none"
// add a system message), `response_format` (json_object / json_schema add one), plus K3's
// `thinking` (default true), `thinking_effort` (low / high / max; absent means no effort message)
// and `add_generation_prompt` (default true).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace k3 {

class Tokenizer;

struct ChatSegment {
  std::string text;
  bool special = false;  // control token (encoded with specials allowed); else ordinary text
  bool operator==(const ChatSegment&) const = default;
};

// The text a message or element renders around: control tokens and built-in strings.
inline constexpr const char* kXtmlOpen = "<|open|>";
inline constexpr const char* kXtmlClose = "<|close|>";
inline constexpr const char* kXtmlSep = "<|sep|>";
inline constexpr const char* kXtmlEndOfMsg = "<|end_of_msg|>";
inline constexpr const char* kXtmlImagePlaceholder = "<|kimi_image_placeholder|>";

// An image part of a message's content as render_chat met it (each renders as one kXtmlImagePlaceholder).
struct ChatImagePart {
  nlohmann::ordered_json part;
  std::string field;  // e.g. messages[1].content[0]
};

// Segments of a request; throws k3::Error naming the offending field (e.g. messages[2].role). `images` (optional)
// receives the image parts in the order their placeholders appear.
std::vector<ChatSegment> render_chat(const nlohmann::ordered_json& request,
                                     std::vector<ChatImagePart>* images = nullptr);

// The schema of a json_schema response format as the reference extracts it: response_format
// .json_schema.schema, else .json_schema.json_schema, else the json_schema object itself; null when
// there is none.
nlohmann::ordered_json response_format_schema(const nlohmann::ordered_json& response_format);

// The rendered prompt: the segments' texts concatenated.
std::string join_segments(const std::vector<ChatSegment>& segments);

// Token ids: each segment encoded on its own (specials allowed only in special segments).
std::vector<int32_t> encode_segments(const Tokenizer& tok, const std::vector<ChatSegment>& segments);

// Parses a request body (JSON nested deeper than kMaxJsonDepth is refused, core/json.h); errors name
// `where`, e.g. the file.
nlohmann::ordered_json parse_chat_request(std::string_view text, const std::string& where);
// Reads and parses a request file (errors name the file).
nlohmann::ordered_json load_chat_request(const std::string& path);

}  // namespace k3
