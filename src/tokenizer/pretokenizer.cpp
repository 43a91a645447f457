#include "tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "core/error.h"

namespace k3 {

const char* const kK3Pattern =
    "[\\p{Han}]+"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]"
    "]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]"
    "]*"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    "|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)"
    "|\\s+";

std::string pattern_by_name(const std::string& name) {
  if (name == "k3") return kK3Pattern;
  fail("--pattern: unknown pattern '", name, "' (supported: k3)");
}

std::string translate_class_intersections(const std::string& p) {
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] == '\\' && i + 1 < p.size()) {  // escaped character: copy both
      out += p.substr(i, 2);
      i += 2;
      continue;
    }
    if (p[i] != '[') {
      out += p[i++];
      continue;
    }
    // A class: find its end (escapes skipped; nested classes only appear after "&&").
    size_t j = i + 1, amp = std::string::npos;
    if (j < p.size() && p[j] == '^') ++j;
    if (j < p.size() && p[j] == ']') ++j;  // a leading ']' is literal
    while (j < p.size() && p[j] != ']') {
      if (p[j] == '\\') ++j;
      else if (p[j] == '&' && j + 1 < p.size() && p[j + 1] == '&') {
        amp = j;
        break;
      }
      ++j;
    }
    if (amp == std::string::npos) {  // plain class
      out += p.substr(i, j + 1 - i);
      i = j + 1;
      continue;
    }
    // [A&&[^B]] : A = p[i+1 .. amp), nested negated class from amp+2 to its ']', then the outer ']'.
    if (amp + 3 >= p.size() || p[amp + 2] != '[' || p[amp + 3] != '^')
      fail("pre-tokenizer pattern: only intersections of the form [A&&[^B]] are supported (at offset ", i, ")");
    size_t k = amp + 4;
    while (k < p.size() && p[k] != ']') k += p[k] == '\\' ? 2 : 1;
    if (k + 1 >= p.size() || p[k + 1] != ']')
      fail("pre-tokenizer pattern: unterminated class intersection at offset ", i);
    const std::string a = p.substr(i + 1, amp - i - 1), b = p.substr(amp + 4, k - amp - 4);
    out += "(?:(?![" + b + "])[" + a + "])";
    i = k + 2;
  }
  return out;
}

size_t utf8_sequence_length(std::string_view t, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(t[k]); };
  const unsigned c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  unsigned lo = 0x80, hi = 0xbf;  // allowed range of the second byte (RFC 3629 table)
  if (c >= 0xc2 && c <= 0xdf) n = 2;
  else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
    if (c == 0xe0) lo = 0xa0;       // no overlong 3-byte forms
    else if (c == 0xed) hi = 0x9f;  // no surrogates
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
    if (c == 0xf0) lo = 0x90;       // no overlong 4-byte forms
    else if (c == 0xf4) hi = 0x8f;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  if (i + n > t.size()) return 0;
  if (b(i + 1) < lo || b(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if ((b(i + k) & 0xc0) != 0x80) return 0;
  return n;
}

namespace {

// Per-thread match resources. A piece can be a 25,000-character run (Kimi's cut limit), and the
// K3 pattern's `(?:(?!Han)[...])*` loops use JIT stack (or interpreter heap) in proportion to it:
// PCRE2's default 32 KiB JIT stack fails at a few thousand letters. The stack is reserved up to
// 256 MiB of address space but only touched as deep as a match needs.
struct MatchResources {
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchResources() {
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 256 * 1024 * 1024, nullptr);
    if (!ctx || !stack) fail("pre-tokenizer: cannot allocate the regex match stack");
    pcre2_jit_stack_assign(ctx, nullptr, stack);
    pcre2_set_heap_limit(ctx, 256 * 1024);  // KiB, for the interpreter when JIT is unavailable
  }
  ~MatchResources() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(ctx);
  }
};

pcre2_match_context* thread_match_context() {
  thread_local MatchResources r;
  return r.ctx;
}

}  // namespace

std::string to_valid_utf8(std::string_view t) {
  std::string out;
  out.reserve(t.size());
  size_t i = 0;
  while (i < t.size()) {
    const size_t n = utf8_sequence_length(t, i);
    if (n > 0) {
      out.append(t, i, n);
      i += n;
      continue;
    }
    // The maximal subpart: a lead byte followed by the continuation bytes it allows, cut short.
    const auto c = static_cast<unsigned char>(t[i]);
    size_t want = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 1;
    size_t k = 1;
    for (; k < want && i + k < t.size(); ++k) {
      const auto b = static_cast<unsigned char>(t[i + k]);
      unsigned lo = 0x80, hi = 0xbf;
      if (k == 1 && c == 0xe0) lo = 0xa0;
      if (k == 1 && c == 0xed) hi = 0x9f;
      if (k == 1 && c == 0xf0) lo = 0x90;
      if (k == 1 && c == 0xf4) hi = 0x8f;
      if (b < lo || b > hi) break;
    }
    out += "\xEF\xBF\xBD";
    i += k;
  }
  return out;
}

struct PreTokenizer::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Impl() { pcre2_code_free(code); }

  // Successive non-empty matches in valid UTF-8 text (tiktoken's find_iter; the K3 pattern has no
  // empty match, but a custom pattern may, and then we step one character as find_iter does).
  void matches(std::string_view text, const std::function<void(std::string_view)>& fn) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
    if (!md) fail("pre-tokenizer: out of memory");
    const auto* s = reinterpret_cast<PCRE2_SPTR>(text.data());
    pcre2_match_context* ctx = thread_match_context();
    size_t pos = 0;
    while (pos < text.size()) {
      // The text was validated by the caller, so PCRE2's own UTF check is skipped.
      const int rc = jit ? pcre2_jit_match(code, s, text.size(), pos, PCRE2_NO_UTF_CHECK, md, ctx)
                         : pcre2_match(code, s, text.size(), pos, PCRE2_NO_UTF_CHECK, md, ctx);
      if (rc == PCRE2_ERROR_NOMATCH) {
        // Text no alternative matches (impossible with the K3 pattern, whose last branch is \s+ and
        // whose others cover every non-space): it is not dropped but emitted as one piece, so
        // encode/decode stay lossless under any pattern.
        fn(text.substr(pos));
        break;
      }
      if (rc < 0) {
        pcre2_match_data_free(md);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        fail("pre-tokenizer: regex match failed at byte ", pos, ": ", reinterpret_cast<char*>(msg));
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[0] > pos) fn(text.substr(pos, ov[0] - pos));  // unmatched gap: keep it (see above)
      if (ov[1] == ov[0]) {                                // empty match: step over one character
        const size_t n = utf8_sequence_length(text, ov[0]);
        if (ov[0] + n > pos) fn(text.substr(ov[0], n));
        pos = ov[0] + n;
        continue;
      }
      fn(text.substr(ov[0], ov[1] - ov[0]));
      pos = size_t(ov[1]);
    }
    pcre2_match_data_free(md);
  }
};

PreTokenizer::PreTokenizer(const std::string& pattern) : impl_(std::make_unique<Impl>()) {
  const std::string translated = translate_class_intersections(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.c_str()), translated.size(),
                              PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (!impl_->code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    fail("pre-tokenizer pattern does not compile at offset ", off, ": ", reinterpret_cast<char*>(msg));
  }
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

void PreTokenizer::for_each_piece(std::string_view text, const std::function<void(std::string_view)>& fn) const {
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    while (j < text.size()) {
      const size_t n = utf8_sequence_length(text, j);
      if (n == 0) break;
      j += n;
    }
    if (j > i) {
      impl_->matches(text.substr(i, j - i), fn);
      i = j;
    } else {
      fn(text.substr(i, 1));
      ++i;
    }
  }
}

}  // namespace k3
