// Runs LLVMFuzzerTestOneInput (tests/fuzz/fuzz_codec.cc) where no libFuzzer is linked in: the kept
// inputs under g++'s sanitizers in `make test`. Arguments: packs (a .pack file, tests/fuzz/pack.py's
// records of a little-endian uint32 length and that many bytes), files, or folders of files (sorted).
// Prints how many inputs ran; a violated property or a sanitizer's report stops it with a non-zero
// status.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

static Bytes read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

static bool is_pack(const fs::path& p) { return p.extension() == ".pack"; }

// The inputs an argument names, in order.
static std::vector<Bytes> inputs(const fs::path& p) {
  std::vector<Bytes> out;
  if (fs::is_directory(p)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(p))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) out.push_back(read_file(f));
  } else if (is_pack(p)) {
    const Bytes pack = read_file(p);
    for (size_t at = 0; at < pack.size();) {
      uint32_t n = 0;
      if (pack.size() - at < 4) break;
      std::memcpy(&n, pack.data() + at, 4);
      at += 4;
      if (pack.size() - at < n) {
        std::fprintf(stderr, "replay: %s is cut short\n", p.c_str());
        std::exit(2);
      }
      out.emplace_back(pack.begin() + at, pack.begin() + at + n);
      at += n;
    }
  } else {
    out.push_back(read_file(p));
  }
  return out;
}

int main(int argc, char** argv) {
  LLVMFuzzerInitialize(&argc, &argv);
  size_t count = 0;
  for (int i = 1; i < argc; ++i)
    for (const Bytes& b : inputs(argv[i])) {
      LLVMFuzzerTestOneInput(b.data(), b.size());
      ++count;
    }
  std::printf("replayed %zu inputs\n", count);
  return count ? 0 : 2;
}
