// k3 generate: prefill a prompt (token ids, text, or a chat request), then decode new tokens one at
// a time from the cache.
#include <cstdio>
#include <memory>
#include <optional>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine.h"
#include "core/error.h"
#include "model/generate.h"
#include "model/vision.h"
#include "multimodal/media_prompt.h"
#include "tokenizer/python_json.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/xtml_chat.h"
#include "tokenizer/xtml_parse.h"

namespace k3::cli {

void register_generate(CLI::App& app) {
  struct Opts {
    std::string model = "tests/fixtures/k3-tiny-a";
    std::string ids = "203,802,2,239,451,327,163,54";
    std::string prompt, request, tokenizer;
    std::vector<std::string> images;
    int64_t max_new = 24;
    bool greedy = false, print_ids = false, allow_special = false;
    float temperature = 1.0f, top_p = 1.0f;
    int64_t top_k = 0;
    uint64_t seed = 0;
    DeviceOptions device;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* sub = app.add_subcommand(
      "generate",
      "Generate tokens after a prompt (incremental decoding: the KDA state and the MLA latent cache carry\n"
      "the prefix). Reads MODEL/config.json and its safetensors. The prompt is --ids (token ids), --prompt\n"
      "(text) or --request (an OpenAI-style chat request rendered in K3's XTML format); text needs a\n"
      "tokenizer: MODEL/tiktoken.model, or --tokenizer DIR. Stops after --max-new-tokens or on the\n"
      "config's eos_token_id. Sampling is greedy unless --temperature, --top-k or --top-p is given.\n"
      "Text prompts stream the generated text to stdout; a chat request ends with the parsed assistant\n"
      "message (think, response, tool calls) as JSON. With --print-ids the last line of stdout is the\n"
      "generated ids separated by spaces. Images (a model with a vision_config): --image FILE with --prompt\n"
      "makes a one-message chat of the images and the text; a --request's image_url parts may name files or\n"
      "data URLs. Each image is encoded by the vision tower and projector on the CPU.");
  sub->add_option("--model", o->model, "model directory (config.json + model.safetensors or shards)")
      ->capture_default_str();
  auto* ids_opt = sub->add_option("--ids", o->ids, "prompt: comma-separated token ids")->capture_default_str();
  auto* prompt_opt = sub->add_option("--prompt", o->prompt, "prompt text (tokenised with the model's tokenizer)");
  auto* request_opt =
      sub->add_option("--request", o->request, "chat request JSON file (rendered as XTML, then tokenised)");
  sub->add_option("--tokenizer", o->tokenizer,
                  "tokenizer directory (tiktoken.model [+ tokenizer_config.json]); default: --model");
  auto* image_opt = sub->add_option(
      "--image", o->images,
      "PNG or JPEG file (repeatable): with --prompt, the prompt becomes a user message of these images and the text");
  auto* allow =
      sub->add_flag("--allow-special", o->allow_special,
                    "with --prompt: special-token text such as <|open|> becomes its id (default: plain text)");
  sub->add_option("--max-new-tokens", o->max_new, "tokens to generate at most")->capture_default_str();
  auto* greedy = sub->add_flag("--greedy", o->greedy, "pick the most likely token (the default)");
  auto* temp = sub->add_option("--temperature", o->temperature, "sampling temperature (> 0)");
  auto* topk = sub->add_option("--top-k", o->top_k, "sample among the K most likely tokens (0: all)");
  auto* topp =
      sub->add_option("--top-p", o->top_p, "sample from the smallest set with this probability mass, in (0, 1]");
  sub->add_option("--seed", o->seed, "random seed for sampling")->capture_default_str();
  add_device_options(sub, o->device);
  sub->add_flag("--print-ids", o->print_ids, "print only the generated ids (the last line of stdout)");
  greedy->excludes(temp)->excludes(topk)->excludes(topp);
  ids_opt->excludes(prompt_opt)->excludes(request_opt);
  prompt_opt->excludes(request_opt);
  allow->needs(prompt_opt);
  image_opt->needs(prompt_opt);
  allow->excludes(image_opt);
  sub->callback([o, temp, topk, topp, prompt_opt, request_opt] {
    if (o->max_new < 0) fail("--max-new-tokens must be >= 0, got ", o->max_new);
    SamplingParams sp;
    sp.greedy = !(temp->count() || topk->count() || topp->count());
    sp.temperature = o->temperature;
    sp.top_k = o->top_k;
    sp.top_p = o->top_p;
    sp.seed = o->seed;
    Sampler sampler(sp);

    const bool text_mode = prompt_opt->count() || request_opt->count();
    std::optional<nlohmann::ordered_json> request;
    if (request_opt->count()) request = load_chat_request(o->request);
    if (!o->images.empty()) {  // --prompt with images: one user message, the images first
      nlohmann::ordered_json parts = nlohmann::ordered_json::array();
      for (const std::string& f : o->images) parts.push_back({{"type", "image_url"}, {"image_url", {{"url", f}}}});
      parts.push_back({{"type", "text"}, {"text", o->prompt}});
      request = nlohmann::ordered_json{{"messages", {{{"role", "user"}, {"content", parts}}}}};
    }
    const bool chat_mode = request.has_value();
    std::vector<ChatSegment> segments;
    std::vector<ChatImagePart> image_parts;
    if (request) segments = render_chat(*request, &image_parts);  // bad requests fail before the model loads
    const std::vector<Image8> images = load_chat_images(image_parts, MediaSources{true});

    std::unique_ptr<Engine> engine = load_engine(o->model, o->device);
    Engine& m = *engine;
    std::optional<Tokenizer> tok;
    std::vector<int32_t> prompt;
    MediaPrompt media;  // the images' rows (none without images)
    if (text_mode) {
      tok = load_tokenizer(o->model, o->tokenizer, m.config());
      std::unique_ptr<VisionEncoder> vision;  // on the engine's device: the GPU (bf16) with --device cuda
      if (!images.empty() && m.config().has_vision_config) {
        vision = load_vision_encoder(o->model, m.options().device);
        std::fprintf(stderr, "[%.2fs] vision tower and projector: %s\n", elapsed_seconds(),
                     vision->description().c_str());
      }
      if (request) media = encode_media_prompt(*tok, vision.get(), m.config().hidden_size, segments, images);
      prompt = request ? media.ids : tok->encode(o->prompt, o->allow_special);
      int64_t image_tokens = 0;
      for (const InputRows& r : media.rows) image_tokens += r.n;
      if (!images.empty())
        std::fprintf(stderr, "%zu image(s): %lld prompt tokens from the vision tower\n", images.size(),
                     (long long)image_tokens);
      if (prompt.empty()) fail("--prompt: the text encodes to no tokens");
    } else {
      prompt = parse_ids(o->ids, "--ids");
      if (!o->tokenizer.empty()) tok = load_tokenizer(o->model, o->tokenizer, m.config());
    }
    check_ids_in_vocab({prompt}, m.config().vocab_size, text_mode ? "the tokenised prompt" : "--ids",
                       m.config().source);

    // Stream the text as it is generated (bytes of a multi-byte character may arrive in two steps).
    std::vector<int32_t> so_far;
    size_t printed = 0;
    auto on_token = [&](int32_t id) {
      if (!tok || o->print_ids || id >= tok->vocab_size()) return;
      so_far.push_back(id);
      const std::string text = tok->decode(so_far);
      std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
      std::fflush(stdout);
      printed = text.size();
    };
    GenerateResult r = generate(m.pick_session(media.rows), m.config(), prompt, o->max_new, sampler, on_token);
    if (printed) std::printf("\n");

    const std::string ids = join_ids(r.tokens);
    if (o->print_ids) {
      std::printf("%s\n", ids.c_str());
      return;
    }
    const double n = double(r.tokens.size());
    std::printf("prompt: %zu tokens, prefill %.3f s (%.1f tok/s)\n", prompt.size(), r.prefill_seconds,
                double(prompt.size()) / std::max(r.prefill_seconds, 1e-9));
    std::printf("generated: %zu tokens, decode %.3f s (%.1f tok/s), stopped on %s\n", r.tokens.size(), r.decode_seconds,
                n > 1 ? (n - 1) / std::max(r.decode_seconds, 1e-9) : 0.0, r.stopped_on_eos ? "eos" : "max-new-tokens");
    if (chat_mode) {
      // The generation prompt left the model in the think channel (or response, when not thinking).
      const bool thinking = !request->contains("thinking") || (*request)["thinking"] != false;
      const XtmlAssistantMessage msg =
          parse_assistant(xtml_pieces_from_ids(*tok, r.tokens), thinking ? XtmlStart::kThink : XtmlStart::kResponse);
      std::printf("message: %s\n", python_json_dumps(msg.to_openai(), false).c_str());
      if (!msg.complete) std::printf("(the message is incomplete: generation stopped before its end)\n");
    }
    std::printf("ids: %s\n", ids.c_str());
  });
}

}  // namespace k3::cli
