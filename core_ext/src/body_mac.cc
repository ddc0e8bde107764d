#include "body_mac.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "auth.h"
#include "common.h"

namespace bps {

namespace {

// The six OpenSSL 3 EVP_MAC entry points Poly1305 needs, resolved once. No OpenSSL headers
// or link-time dependency: a machine without libcrypto.so.3 simply uses HMAC-SHA256.
struct Crypto {
  void* (*mac_fetch)(void*, const char*, const char*) = nullptr;
  void* (*ctx_new)(void*) = nullptr;
  int (*init)(void*, const unsigned char*, size_t, const void*) = nullptr;
  int (*update)(void*, const unsigned char*, size_t) = nullptr;
  int (*final)(void*, unsigned char*, size_t*, size_t) = nullptr;
  void (*ctx_free)(void*) = nullptr;
  void* poly1305 = nullptr;  // the fetched EVP_MAC, shared by every context
};

const Crypto* LoadCrypto() {
  static const Crypto* crypto = [] () -> const Crypto* {
    void* lib = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return nullptr;
    auto* c = new Crypto;
    c->mac_fetch = reinterpret_cast<decltype(c->mac_fetch)>(dlsym(lib, "EVP_MAC_fetch"));
    c->ctx_new = reinterpret_cast<decltype(c->ctx_new)>(dlsym(lib, "EVP_MAC_CTX_new"));
    c->init = reinterpret_cast<decltype(c->init)>(dlsym(lib, "EVP_MAC_init"));
    c->update = reinterpret_cast<decltype(c->update)>(dlsym(lib, "EVP_MAC_update"));
    c->final = reinterpret_cast<decltype(c->final)>(dlsym(lib, "EVP_MAC_final"));
    c->ctx_free = reinterpret_cast<decltype(c->ctx_free)>(dlsym(lib, "EVP_MAC_CTX_free"));
    if (c->mac_fetch && c->ctx_new && c->init && c->update && c->final && c->ctx_free)
      c->poly1305 = c->mac_fetch(nullptr, "POLY1305", nullptr);
    if (!c->poly1305) {
      delete c;
      return nullptr;  // the library stays loaded: dlclose could race other users
    }
    return c;
  }();
  return crypto;
}

}  // namespace

const char* BodyAuthName(BodyAuth mode) {
  switch (mode) {
    case BodyAuth::kPoly1305: return "poly1305";
    case BodyAuth::kNone: return "none";
    default: return "hmac-sha256";
  }
}

bool Poly1305Available() {
  const char* off = std::getenv("BPSTRAIN_NO_LIBCRYPTO");
  if (off && *off && std::strcmp(off, "0") != 0) return false;
  return LoadCrypto() != nullptr;
}

struct BodyMac::Impl {
  std::unique_ptr<Hmac> hmac;
  void* ctx = nullptr;  // EVP_MAC_CTX for Poly1305
  ~Impl() {
    if (ctx) LoadCrypto()->ctx_free(ctx);
  }
};

BodyMac::BodyMac(BodyAuth mode, const std::string& session_key, uint64_t seq)
    : mode_(mode), impl_(std::make_unique<Impl>()) {
  if (mode == BodyAuth::kHmacSha256) {
    impl_->hmac = std::make_unique<Hmac>(session_key);
    impl_->hmac->U64(seq);
  } else if (mode == BodyAuth::kPoly1305) {
    const Crypto* c = LoadCrypto();
    if (!c) throw Error(Error::kGeneric, "Poly1305 was agreed but libcrypto.so.3 is not loaded");
    // Poly1305 keys must never repeat: one per frame, from the session key and the
    // frame's sequence number.
    const std::string key = Hmac(session_key).Update("poly1305", 8).U64(seq).Final();
    impl_->ctx = c->ctx_new(c->poly1305);
    if (!impl_->ctx || c->init(impl_->ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), nullptr) != 1)
      throw Error(Error::kGeneric, "cannot initialise Poly1305 (libcrypto)");
  }
}

BodyMac::~BodyMac() = default;

void BodyMac::Update(const void* data, size_t n) {
  if (mode_ == BodyAuth::kHmacSha256) impl_->hmac->Update(data, n);
  else if (mode_ == BodyAuth::kPoly1305 && n)
    LoadCrypto()->update(impl_->ctx, static_cast<const unsigned char*>(data), n);
}

std::string BodyMac::Final() {
  if (mode_ == BodyAuth::kHmacSha256) return impl_->hmac->Final().substr(0, kTag);
  if (mode_ == BodyAuth::kNone) return std::string(kTag, '\0');
  unsigned char out[kTag];
  size_t len = 0;
  if (LoadCrypto()->final(impl_->ctx, out, &len, sizeof out) != 1 || len != kTag)
    throw Error(Error::kGeneric, "Poly1305 failed (libcrypto)");
  return std::string(reinterpret_cast<char*>(out), kTag);
}

std::string Poly1305(const std::string& key, const void* data, size_t n) {
  const Crypto* c = LoadCrypto();
  if (!c || key.size() != 32) throw Error(Error::kConfig, "Poly1305 needs libcrypto.so.3 and a 32-byte key");
  void* ctx = c->ctx_new(c->poly1305);
  unsigned char out[16];
  size_t len = 0;
  bool ok = ctx && c->init(ctx, reinterpret_cast<const unsigned char*>(key.data()), 32, nullptr) == 1 &&
            (n == 0 || c->update(ctx, static_cast<const unsigned char*>(data), n) == 1) &&
            c->final(ctx, out, &len, sizeof out) == 1;
  if (ctx) c->ctx_free(ctx);
  if (!ok || len != 16) throw Error(Error::kGeneric, "Poly1305 failed (libcrypto)");
  return std::string(reinterpret_cast<char*>(out), 16);
}

}  // namespace bps
