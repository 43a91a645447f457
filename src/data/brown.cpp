#include "data/brown.h"

#include <cctype>

#include "core/error.h"
#include "io/file.h"

namespace k3::data {

namespace {

bool is_closing(std::string_view w) {
  return w == "," || w == "." || w == ";" || w == ":" || w == "?" || w == "!" || w == ")" || w == "]" || w == "''" ||
         w == "'";
}

bool is_opening(std::string_view w) { return w == "``" || w == "(" || w == "["; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

}  // namespace

std::string brown_plain_text(std::string_view tagged, const std::string& where) {
  std::string out;
  size_t line_no = 0;
  while (!tagged.empty()) {
    const size_t nl = tagged.find('\n');
    std::string_view line = trim(tagged.substr(0, nl));
    tagged = nl == std::string_view::npos ? std::string_view() : tagged.substr(nl + 1);
    ++line_no;
    if (line.empty()) continue;
    std::string sentence;
    bool glue_next = true;  // no space before the first word, nor after an opening mark
    std::string_view prev_word;
    bool prev_mark = false;
    while (!line.empty()) {
      const size_t sp = line.find_first_of(" \t");
      const std::string_view tok = line.substr(0, sp);
      line = sp == std::string_view::npos ? std::string_view() : trim(line.substr(sp));
      const size_t slash = tok.rfind('/');
      if (slash == std::string_view::npos || slash == 0 || slash + 1 == tok.size())
        fail(where, ":", line_no, ": token '", std::string(tok), "' is not word/tag");
      std::string_view word = tok.substr(0, slash);
      const std::string_view tag = tok.substr(slash + 1);  // non-empty (checked above)
      // This release doubles many sentence-final marks (";/. ;/.", "?/. ?/."), and abbreviations
      // carry their own period before the sentence's ("Jr./np ./."): print one mark, not two.
      // (Tags may carry suffixes such as "-hl" for headlines: ".-hl".)
      const bool mark = tag[0] == '.';
      if (mark && !sentence.empty() && (prev_mark ? word == prev_word : word == "." && sentence.back() == '.'))
        continue;
      prev_word = word;
      prev_mark = mark;
      const bool closing = is_closing(word);
      const bool opening = is_opening(word);
      if (!glue_next && !closing) sentence += ' ';
      if (word == "``" || word == "''") sentence += '"';
      else sentence += word;
      glue_next = opening;
    }
    out += sentence;
    out += '\n';
  }
  return out;
}

std::vector<BrownDocument> read_brown_corpus(const std::string& dir) {
  const std::string cats_path = dir + "/cats.txt";
  const std::string cats = read_file(cats_path, "Brown corpus category list (install it: scripts/setup.sh)");
  std::vector<BrownDocument> docs;
  size_t pos = 0, line_no = 0;
  while (pos < cats.size()) {
    const size_t nl = cats.find('\n', pos);
    std::string_view line =
        trim(std::string_view(cats).substr(pos, nl == std::string::npos ? std::string::npos : nl - pos));
    pos = nl == std::string::npos ? cats.size() : nl + 1;
    ++line_no;
    if (line.empty()) continue;
    const size_t sp = line.find_first_of(" \t");
    if (sp == std::string_view::npos) fail(cats_path, ":", line_no, ": expected '<sample> <category>'");
    BrownDocument d;
    d.id = std::string(line.substr(0, sp));
    d.category = std::string(trim(line.substr(sp)));
    for (char ch : d.id)
      if (!std::isalnum(static_cast<unsigned char>(ch)))
        fail(cats_path, ":", line_no, ": bad sample name '", d.id, "'");
    const std::string path = dir + "/" + d.id;
    d.text = brown_plain_text(read_file(path, "Brown corpus sample"), path);
    if (d.text.empty()) fail(path, ": no text");
    docs.push_back(std::move(d));
  }
  if (docs.empty()) fail(cats_path, ": lists no samples");
  return docs;
}

bool brown_is_heldout(const std::vector<BrownDocument>& docs, size_t index, int every) {
  if (every < 2) fail("held-out split: every must be >= 2, got ", every);
  if (index >= docs.size()) fail("held-out split: index ", index, " of ", docs.size(), " documents");
  size_t rank = 0;  // position of docs[index] within its category
  for (size_t i = 0; i < index; ++i) rank += docs[i].category == docs[index].category;
  return (rank + 1) % size_t(every) == 0;
}

}  // namespace k3::data
