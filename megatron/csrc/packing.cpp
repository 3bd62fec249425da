// One packed message per peer: the C++ side of megatron/core/pipeline_parallel/packing.py.
//
// This file owns the binary message format used to send every tensor bound for one pipeline peer
// at one communication point as a single contiguous uint8 buffer. The pure-Python twin in
// packing.py writes byte-identical buffers; keep the two in step (tests compare their bytes).
//
// Layout (all integers little-endian):
//   fixed header, 32 bytes
//     0  magic "MCPK"            4 bytes
//     4  format version          uint16  (kFormatVersion)
//     6  payload alignment       uint16  (kAlignment)
//     8  tensor count            uint32
//    12  header CRC-32           uint32  (zlib's CRC-32 of the header bytes, this field as zero)
//    16  header bytes            uint64  (fixed header + entries, before padding)
//    24  total bytes             uint64  (the whole buffer)
//   one entry per tensor, 16 + 8 * ndim bytes
//     0  dtype code              uint8   (stable codes, see dtype_table)
//     1  ndim                    uint8
//     2  reserved, zero          6 bytes
//     8  payload byte offset     uint64  (from the start of the buffer)
//    16  shape                   int64 * ndim
//   zero padding up to the alignment, then each payload (contiguous, row-major) padded with zeros
//   to the alignment. The layout is a pure function of the (shape, dtype) list, which is why a
//   receiver can size its receive buffer in advance and why unpack can check every field.
//
// Only torch tensor operations move payload bytes (narrow/view/copy_), so the same code serves CPU
// and CUDA buffers without any CUDA kernel and compiles without CUDA.

#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kFormatVersion = 1;
constexpr int64_t kAlignment = 64;
constexpr int64_t kFixedHeaderBytes = 32;
constexpr int64_t kEntryBytes = 16;
constexpr int64_t kMaxDims = 64;
// Header bytes copied to the host in one go when parsing a device buffer; larger headers cost a
// second small copy.
constexpr int64_t kHeaderPrefetchBytes = 4096;
constexpr char kMagic[4] = {'M', 'C', 'P', 'K'};
// Above this size copy_ is used even for contiguous CPU tensors, since it can use several threads.
constexpr int64_t kMemcpyMaxBytes = 1 << 20;

static_assert(sizeof(void*) == 8, "the packing format assumes a 64-bit host");

struct DtypeInfo {
  uint8_t code;
  at::ScalarType scalar_type;
  const char* name;
};

// Codes are part of the wire format: never renumber, only append.
const std::vector<DtypeInfo>& dtype_table() {
  static const std::vector<DtypeInfo> table = {
      {1, at::kFloat, "float32"},          {2, at::kDouble, "float64"},
      {3, at::kHalf, "float16"},           {4, at::kBFloat16, "bfloat16"},
      {5, at::kByte, "uint8"},             {6, at::kChar, "int8"},
      {7, at::kShort, "int16"},            {8, at::kInt, "int32"},
      {9, at::kLong, "int64"},             {10, at::kBool, "bool"},
      {11, at::kComplexFloat, "complex64"}, {12, at::kComplexDouble, "complex128"},
      {13, at::kFloat8_e4m3fn, "float8_e4m3fn"}, {14, at::kFloat8_e5m2, "float8_e5m2"},
  };
  return table;
}

[[noreturn]] void fail(const std::string& message) { throw pybind11::value_error(message); }

const DtypeInfo& info_for_scalar_type(at::ScalarType scalar_type) {
  for (const auto& info : dtype_table()) {
    if (info.scalar_type == scalar_type) return info;
  }
  fail(std::string("p2p packing does not support dtype ") + c10::toString(scalar_type) +
       "; convert the tensor to a supported dtype (float32, float64, float16, bfloat16, uint8, "
       "int8, int16, int32, int64, bool, complex64, complex128, float8) or send it unpacked");
}

const DtypeInfo* info_for_code(uint8_t code) {
  for (const auto& info : dtype_table()) {
    if (info.code == code) return &info;
  }
  return nullptr;
}

int64_t align_up(int64_t value) { return (value + kAlignment - 1) / kAlignment * kAlignment; }

// zlib-compatible CRC-32 (reflected polynomial 0xEDB88320), so Python can use zlib.crc32.
uint32_t crc32(const uint8_t* data, size_t length) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> entries{};
    for (uint32_t byte = 0; byte < 256; ++byte) {
      uint32_t value = byte;
      for (int bit = 0; bit < 8; ++bit) value = (value & 1u) ? (value >> 1) ^ 0xEDB88320u : value >> 1;
      entries[byte] = value;
    }
    return entries;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < length; ++i) crc = table[(crc ^ data[i]) & 0xFFu] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFu;
}

bool host_is_little_endian() {
  const uint16_t probe = 1;
  uint8_t first_byte;
  std::memcpy(&first_byte, &probe, 1);
  return first_byte == 1;
}

template <typename T>
void store(std::vector<uint8_t>& bytes, int64_t position, T value) {
  std::memcpy(bytes.data() + position, &value, sizeof(T));
}

template <typename T>
T load(const uint8_t* bytes, int64_t position) {
  T value;
  std::memcpy(&value, bytes + position, sizeof(T));
  return value;
}

struct Entry {
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  int64_t offset;
  int64_t nbytes;
};

// Header size and payload offsets of a message holding tensors of these shapes and item sizes.
struct Layout {
  int64_t header_nbytes = kFixedHeaderBytes;
  std::vector<int64_t> offsets;
  int64_t total_nbytes = 0;
};

Layout compute_layout(const std::vector<int64_t>& ndims, const std::vector<int64_t>& nbytes) {
  Layout layout;
  for (int64_t ndim : ndims) layout.header_nbytes += kEntryBytes + 8 * ndim;
  int64_t cursor = align_up(layout.header_nbytes);
  layout.offsets.reserve(nbytes.size());
  for (int64_t size : nbytes) {
    layout.offsets.push_back(cursor);
    cursor += align_up(size);
  }
  layout.total_nbytes = cursor;
  return layout;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream text;
  text << "(";
  for (size_t i = 0; i < shape.size(); ++i) text << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) text << ",";
  text << ")";
  return text.str();
}

void check_buffer(const at::Tensor& buffer) {
  if (!buffer.defined()) fail("packed buffer is undefined; pass the uint8 tensor returned by pack()");
  if (buffer.scalar_type() != at::kByte || buffer.dim() != 1) {
    fail(std::string("packed buffer must be a 1-D uint8 tensor, got ") + c10::toString(buffer.scalar_type()) +
         " with " + std::to_string(buffer.dim()) + " dims; pass the tensor returned by pack()");
  }
  if (buffer.numel() > 1 && buffer.stride(0) != 1) {
    fail("packed buffer must be contiguous; pass buffer.contiguous()");
  }
}

// Copies the first `nbytes` bytes of a (possibly device) buffer to host memory.
std::vector<uint8_t> host_prefix(const at::Tensor& buffer, int64_t nbytes) {
  std::vector<uint8_t> bytes(static_cast<size_t>(nbytes));
  if (nbytes == 0) return bytes;
  if (buffer.is_cpu()) {  // read in place: no tensor objects on the hot path
    std::memcpy(bytes.data(), buffer.data_ptr<uint8_t>(), static_cast<size_t>(nbytes));
  } else {
    at::Tensor prefix = buffer.narrow(0, 0, nbytes).to(at::kCPU).contiguous();
    std::memcpy(bytes.data(), prefix.data_ptr<uint8_t>(), static_cast<size_t>(nbytes));
  }
  return bytes;
}

// Parses and fully validates the header; every error is a ValueError with the reason.
std::vector<Entry> parse_header(const at::Tensor& buffer) {
  check_buffer(buffer);
  const int64_t buffer_nbytes = buffer.numel();
  if (buffer_nbytes < kFixedHeaderBytes) {
    fail("packed buffer is truncated: it has " + std::to_string(buffer_nbytes) + " bytes but the fixed header needs " +
         std::to_string(kFixedHeaderBytes) + "; check that the receive buffer was sized with packed_nbytes()");
  }
  std::vector<uint8_t> header = host_prefix(buffer, std::min(buffer_nbytes, kHeaderPrefetchBytes));
  if (std::memcmp(header.data(), kMagic, 4) != 0) {
    fail("packed buffer has a bad magic number (expected 'MCPK'): it is not a packed message or it is corrupted");
  }
  const int64_t version = load<uint16_t>(header.data(), 4);
  if (version != kFormatVersion) {
    fail("packed buffer has format version " + std::to_string(version) + " but this build reads version " +
         std::to_string(kFormatVersion) + "; sender and receiver must run the same megatron version");
  }
  const int64_t alignment = load<uint16_t>(header.data(), 6);
  if (alignment != kAlignment) {
    fail("packed buffer header is corrupted: alignment field is " + std::to_string(alignment) + ", expected " +
         std::to_string(kAlignment));
  }
  const int64_t count = load<uint32_t>(header.data(), 8);
  const uint32_t stored_crc = load<uint32_t>(header.data(), 12);
  const uint64_t header_nbytes_field = load<uint64_t>(header.data(), 16);
  const uint64_t total_nbytes_field = load<uint64_t>(header.data(), 24);
  if (total_nbytes_field != static_cast<uint64_t>(buffer_nbytes)) {
    fail("packed buffer is truncated or has trailing bytes: header says " + std::to_string(total_nbytes_field) +
         " bytes, buffer has " + std::to_string(buffer_nbytes) +
         "; size the receive buffer with packed_nbytes() and pass exactly that many bytes");
  }
  const int64_t min_header_nbytes = kFixedHeaderBytes + kEntryBytes * count;
  if (header_nbytes_field < static_cast<uint64_t>(min_header_nbytes) ||
      header_nbytes_field > static_cast<uint64_t>(buffer_nbytes)) {
    fail("packed buffer header is corrupted: header size " + std::to_string(header_nbytes_field) +
         " is inconsistent with " + std::to_string(count) + " tensors in a " + std::to_string(buffer_nbytes) +
         "-byte buffer");
  }
  const int64_t header_nbytes = static_cast<int64_t>(header_nbytes_field);
  if (header_nbytes > static_cast<int64_t>(header.size())) header = host_prefix(buffer, header_nbytes);
  std::vector<uint8_t> checksum_input(header.begin(), header.begin() + header_nbytes);
  std::memset(checksum_input.data() + 12, 0, 4);
  if (crc32(checksum_input.data(), checksum_input.size()) != stored_crc) {
    fail("packed buffer header is corrupted: header checksum mismatch");
  }

  // The checksum matched, but a buffer could still be crafted; validate every field anyway so that
  // no view can reach outside the buffer.
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(count));
  int64_t position = kFixedHeaderBytes;
  for (int64_t index = 0; index < count; ++index) {
    const std::string where = "packed buffer header is corrupted: tensor " + std::to_string(index) + " ";
    if (position + kEntryBytes > header_nbytes) fail(where + "entry runs past the header");
    const uint8_t code = header[position];
    const int64_t ndim = header[position + 1];
    for (int64_t reserved = 2; reserved < 8; ++reserved) {
      if (header[position + reserved] != 0) fail(where + "has non-zero reserved bytes");
    }
    const DtypeInfo* dtype = info_for_code(code);
    if (dtype == nullptr) fail(where + "has unknown dtype code " + std::to_string(code));
    if (ndim > kMaxDims) fail(where + "has " + std::to_string(ndim) + " dims (limit " + std::to_string(kMaxDims) + ")");
    const uint64_t offset = load<uint64_t>(header.data(), position + 8);
    position += kEntryBytes;
    if (position + 8 * ndim > header_nbytes) fail(where + "shape runs past the header");
    std::vector<int64_t> shape(static_cast<size_t>(ndim));
    int64_t numel = 1;
    for (int64_t dim = 0; dim < ndim; ++dim) {
      const int64_t size = load<int64_t>(header.data(), position + 8 * dim);
      if (size < 0) fail(where + "has a negative dimension " + std::to_string(size));
      if (size > 0 && numel > buffer_nbytes / size) numel = buffer_nbytes + 1;  // saturate: cannot fit
      else numel *= size;
      shape[static_cast<size_t>(dim)] = size;
    }
    position += 8 * ndim;
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype->scalar_type));
    if (numel > buffer_nbytes / itemsize) fail(where + "shape " + shape_string(shape) + " does not fit in the buffer");
    entries.push_back(Entry{dtype, std::move(shape), static_cast<int64_t>(std::min<uint64_t>(offset, INT64_MAX)),
                            numel * itemsize});
  }
  if (position != header_nbytes) fail("packed buffer header is corrupted: entries do not fill the header exactly");

  // The layout is deterministic, so every offset and the total size must match a recomputation.
  std::vector<int64_t> ndims, nbytes;
  for (const auto& entry : entries) {
    ndims.push_back(static_cast<int64_t>(entry.shape.size()));
    nbytes.push_back(entry.nbytes);
  }
  const Layout layout = compute_layout(ndims, nbytes);
  for (size_t index = 0; index < entries.size(); ++index) {
    if (entries[index].offset != layout.offsets[index]) {
      fail("packed buffer header is corrupted: tensor " + std::to_string(index) + " offset " +
           std::to_string(entries[index].offset) + " differs from the expected " +
           std::to_string(layout.offsets[index]));
    }
  }
  if (layout.total_nbytes != buffer_nbytes) {
    fail("packed buffer header is corrupted: the tensors need " + std::to_string(layout.total_nbytes) +
         " bytes but the buffer has " + std::to_string(buffer_nbytes));
  }
  return entries;
}

at::Tensor pack(const std::vector<at::Tensor>& tensors, c10::optional<at::Device> device) {
  if (!host_is_little_endian()) fail("p2p packing needs a little-endian host");
  if (tensors.size() > UINT32_MAX) fail("too many tensors for one packed message");
  at::Device target = device.has_value() ? *device : at::Device(at::kCPU);
  std::vector<int64_t> ndims, nbytes;
  std::vector<const DtypeInfo*> dtypes;
  for (size_t index = 0; index < tensors.size(); ++index) {
    const at::Tensor& tensor = tensors[index];
    if (!tensor.defined()) fail("tensor " + std::to_string(index) + " passed to pack() is undefined");
    if (tensor.layout() != at::kStrided) {
      fail("tensor " + std::to_string(index) + " is not a dense strided tensor; call .to_dense() before packing");
    }
    if (!device.has_value()) {
      if (index == 0) target = tensor.device();
      else if (tensor.device() != target) {
        fail("tensors passed to pack() are on different devices (" + target.str() + " and " +
             tensor.device().str() + "); move them to one device or pass device=");
      }
    }
    if (tensor.dim() > kMaxDims) fail("tensor " + std::to_string(index) + " has too many dims for packing");
    dtypes.push_back(&info_for_scalar_type(tensor.scalar_type()));
    ndims.push_back(tensor.dim());
    nbytes.push_back(tensor.numel() * static_cast<int64_t>(tensor.element_size()));
  }
  const Layout layout = compute_layout(ndims, nbytes);
  const int64_t header_region = align_up(layout.header_nbytes);

  std::vector<uint8_t> header(static_cast<size_t>(header_region), 0);
  std::memcpy(header.data(), kMagic, 4);
  store<uint16_t>(header, 4, static_cast<uint16_t>(kFormatVersion));
  store<uint16_t>(header, 6, static_cast<uint16_t>(kAlignment));
  store<uint32_t>(header, 8, static_cast<uint32_t>(tensors.size()));
  store<uint64_t>(header, 16, static_cast<uint64_t>(layout.header_nbytes));
  store<uint64_t>(header, 24, static_cast<uint64_t>(layout.total_nbytes));
  int64_t position = kFixedHeaderBytes;
  for (size_t index = 0; index < tensors.size(); ++index) {
    header[position] = dtypes[index]->code;
    header[position + 1] = static_cast<uint8_t>(ndims[index]);
    store<uint64_t>(header, position + 8, static_cast<uint64_t>(layout.offsets[index]));
    position += kEntryBytes;
    for (int64_t size : tensors[index].sizes()) {
      store<int64_t>(header, position, size);
      position += 8;
    }
  }
  store<uint32_t>(header, 12, crc32(header.data(), static_cast<size_t>(layout.header_nbytes)));

  // Packing copies activations into a transport buffer; it must not enter the autograd graph.
  at::NoGradGuard no_grad;
  at::Tensor buffer = at::empty({layout.total_nbytes}, at::TensorOptions().dtype(at::kByte).device(target));
  const bool on_cpu = target.is_cpu();
  if (on_cpu) {
    std::memcpy(buffer.data_ptr<uint8_t>(), header.data(), header.size());
  } else {
    at::Tensor host_header = at::from_blob(header.data(), {header_region}, at::TensorOptions().dtype(at::kByte));
    buffer.narrow(0, 0, header_region).copy_(host_header);
  }
  for (size_t index = 0; index < tensors.size(); ++index) {
    const at::Tensor& tensor = tensors[index];
    const int64_t offset = layout.offsets[index];
    // Small contiguous CPU tensors are copied with memcpy: for them the cost of creating the
    // destination view and dispatching copy_ exceeds the copy itself. Lazily conjugated or negated
    // tensors must go through copy_, which materializes the conjugation/negation.
    const bool plain_host_copy = on_cpu && tensor.is_cpu() && tensor.is_contiguous() && !tensor.is_conj() &&
                                 !tensor.is_neg() && nbytes[index] <= kMemcpyMaxBytes;
    if (plain_host_copy && nbytes[index] > 0) {
      std::memcpy(buffer.data_ptr<uint8_t>() + offset, tensor.data_ptr(), static_cast<size_t>(nbytes[index]));
    } else if (nbytes[index] > 0) {
      buffer.narrow(0, offset, nbytes[index]).view(tensor.scalar_type()).view(tensor.sizes()).copy_(tensor);
    }
    // Padding is zeroed so that the bytes are deterministic (and identical to the Python twin).
    const int64_t padding = align_up(nbytes[index]) - nbytes[index];
    if (padding > 0) {
      if (on_cpu) std::memset(buffer.data_ptr<uint8_t>() + offset + nbytes[index], 0, static_cast<size_t>(padding));
      else buffer.narrow(0, offset + nbytes[index], padding).zero_();
    }
  }
  return buffer;
}

std::vector<at::Tensor> unpack(at::Tensor buffer, c10::optional<at::Device> device) {
  if (!host_is_little_endian()) fail("p2p packing needs a little-endian host");
  check_buffer(buffer);
  if (device.has_value() && buffer.device() != *device) buffer = buffer.to(*device);
  const std::vector<Entry> entries = parse_header(buffer);
  std::vector<at::Tensor> views;
  views.reserve(entries.size());
  for (size_t index = 0; index < entries.size(); ++index) {
    const Entry& entry = entries[index];
    const int64_t itemsize = static_cast<int64_t>(c10::elementSize(entry.dtype->scalar_type));
    // A dtype view needs the element to start at a multiple of its size inside the storage; only a
    // buffer sliced out of a larger one at an odd position can break this.
    if ((buffer.storage_offset() + entry.offset) % itemsize != 0) {
      fail("packed buffer starts at storage byte offset " + std::to_string(buffer.storage_offset()) +
           ", which is not aligned for " + entry.dtype->name + "; unpack buffer.clone() instead");
    }
    views.push_back(buffer.narrow(0, entry.offset, entry.nbytes).view(entry.dtype->scalar_type).view(entry.shape));
  }
  return views;
}

// (shape, dtype code, payload offset) per tensor, for layout checks without creating views.
std::vector<std::tuple<std::vector<int64_t>, int64_t, int64_t>> read_layout(const at::Tensor& buffer) {
  std::vector<std::tuple<std::vector<int64_t>, int64_t, int64_t>> layout;
  for (const auto& entry : parse_header(buffer)) {
    layout.emplace_back(entry.shape, static_cast<int64_t>(entry.dtype->code), entry.offset);
  }
  return layout;
}

// Exact size of a packed message from (ndim, payload bytes) per tensor.
int64_t packed_nbytes(const std::vector<std::pair<int64_t, int64_t>>& ndims_and_nbytes) {
  std::vector<int64_t> ndims, nbytes;
  for (const auto& [ndim, size] : ndims_and_nbytes) {
    if (ndim < 0 || ndim > kMaxDims || size < 0) fail("packed_nbytes got an invalid (ndim, nbytes) pair");
    ndims.push_back(ndim);
    nbytes.push_back(size);
  }
  return compute_layout(ndims, nbytes).total_nbytes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "Packs the tensors bound for one pipeline peer into one uint8 message (see packing.py).";
  module.def("pack", &pack, "Packs tensors into one uint8 buffer.", pybind11::arg("tensors"),
             pybind11::arg("device") = pybind11::none());
  module.def("unpack", &unpack, "Returns views into a packed buffer.", pybind11::arg("buffer"),
             pybind11::arg("device") = pybind11::none());
  module.def("read_layout", &read_layout, "Validated (shape, dtype code, offset) per tensor.", pybind11::arg("buffer"));
  module.def("packed_nbytes", &packed_nbytes, "Message size from (ndim, nbytes) pairs.",
             pybind11::arg("ndims_and_nbytes"));
  module.def("format_version", [] { return kFormatVersion; });
  module.def("alignment", [] { return kAlignment; });
  module.def("dtype_codes", [] {
    std::vector<std::pair<int64_t, std::string>> codes;
    for (const auto& info : dtype_table()) codes.emplace_back(info.code, info.name);
    return codes;
  });
}
