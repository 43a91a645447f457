// libFuzzer target: the XTML chat code on untrusted input, both ways.
//
//   scripts/fuzz.sh [SECONDS]                       (builds build-fuzz with clang, runs every target)
//   build-fuzz/fuzz_chat_parse build-fuzz/corpus/fuzz_chat_parse -dict=fuzz/fuzz_chat_parse.dict
//
// The first byte picks what the rest is:
//   0-2: generated text, parsed from each start (think / response / message body), or
//   3-5: a piece sequence (bytes < 6 are <|open|> <|close|> <|sep|> <|end_of_msg|> or another
//        special; the rest is text), parsed the same way: what a model can emit in ids;
//   else: a chat request body (JSON) for render_chat, which is what a server receives.
// It aborts when parsing throws anything, when the parsed message's JSON is not valid UTF-8 JSON
// (nlohmann re-parses it), when parse_chat_request or render_chat throws anything but k3::Error, or
// when a rendered request's segments are empty text. ASan and UBSan catch memory errors on the way,
// and a stack overflow from nesting (JSON 20,000 levels deep in a request or in generated tool-call
// arguments) is a crash: scripts/fuzz.sh seeds both and lets inputs grow to 256 KiB to reach them.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/python_json.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"

namespace {

void check_parse(const std::vector<k3::XtmlPiece>& pieces) {
  for (k3::XtmlStart start : {k3::XtmlStart::kThink, k3::XtmlStart::kResponse, k3::XtmlStart::kMessageBody}) {
    const k3::XtmlAssistantMessage m = k3::parse_assistant(pieces, start);
    const std::string json = k3::python_json_dumps(m.to_openai(), false);
    if (!nlohmann::json::accept(json)) {
      std::fprintf(stderr, "to_openai() is not valid JSON: %s\n", json.c_str());
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (mode < 3) {
    check_parse(k3::xtml_pieces_from_text(rest));
  } else if (mode < 6) {
    static const k3::XtmlPieceKind kinds[] = {k3::XtmlPieceKind::kOpen,         k3::XtmlPieceKind::kClose,
                                              k3::XtmlPieceKind::kSep,          k3::XtmlPieceKind::kEndOfMsg,
                                              k3::XtmlPieceKind::kOtherSpecial, k3::XtmlPieceKind::kOtherSpecial};
    std::vector<k3::XtmlPiece> pieces;
    for (char c : rest) {
      if (uint8_t(c) < 6) {
        pieces.push_back({kinds[uint8_t(c)], "<special>"});
      } else if (!pieces.empty() && pieces.back().kind == k3::XtmlPieceKind::kText) {
        pieces.back().text += c;
      } else {
        pieces.push_back({k3::XtmlPieceKind::kText, std::string(1, c)});
      }
    }
    check_parse(pieces);
  } else {
    try {
      // The server's path: the bounded parse (core/json.h) refuses what nests too deep, cleanly.
      const nlohmann::ordered_json req = k3::parse_chat_request(rest, "fuzz input");
      for (const k3::ChatSegment& s : k3::render_chat(req)) {
        if (s.text.empty()) {
          std::fprintf(stderr, "render_chat produced an empty segment\n");
          std::abort();
        }
      }
    } catch (const k3::Error&) {
      // A clear rejection is the right answer to a bad request.
    }
  }
  return 0;
}
