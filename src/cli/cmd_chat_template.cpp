// k3 chat-template: shows how a chat request is rendered in XTML and tokenised.
#include <cstdio>
#include <memory>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"

namespace k3::cli {

void register_chat_template(CLI::App& app) {
  struct Opts {
    std::string request, model;
    bool print_segments = false, print_ids = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "chat-template",
      "Render an OpenAI-style chat request (messages, tools, tool_choice, response_format, plus K3's\n"
      "thinking, thinking_effort, add_generation_prompt) in Kimi K3's XTML chat format. Prints the\n"
      "rendered prompt; --print-segments prints the segments one JSON object per line\n"
      "({\"text\": ..., \"special\": true|false}; each segment is tokenised on its own); --print-ids\n"
      "prints the token ids (with the tokenizer of --model DIR: DIR/tiktoken.model and, when present,\n"
      "DIR/tokenizer_config.json); the last line of stdout is the ids separated by spaces.");
  sub->add_option("--request", o->request, "chat request JSON file")->required();
  auto* seg = sub->add_flag("--print-segments", o->print_segments, "print the segments, one JSON object per line");
  auto* ids = sub->add_flag("--print-ids", o->print_ids, "print the token ids (needs --model)");
  auto* model = sub->add_option("--model", o->model, "model or tokenizer directory holding tiktoken.model");
  seg->excludes(ids);
  sub->callback([o, model] {
    const std::vector<ChatSegment> segments = render_chat(load_chat_request(o->request));
    if (o->print_segments) {
      for (const ChatSegment& s : segments)
        std::printf("%s\n", python_json_dumps({{"text", s.text}, {"special", s.special}}, false).c_str());
      return;
    }
    if (o->print_ids) {
      if (!model->count()) fail("chat-template: --print-ids needs --model DIR (a directory with tiktoken.model)");
      const Tokenizer tok = Tokenizer::load_dir(o->model);
      const std::vector<int32_t> out = encode_segments(tok, segments);
      std::printf("%s\n", join_ids(out).c_str());
      return;
    }
    const std::string text = join_segments(segments);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  });
}

}  // namespace k3::cli
