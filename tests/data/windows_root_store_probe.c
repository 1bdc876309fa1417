/* dfbuild test probe: load the Windows ROOT and CA stores into an OpenSSL X509_STORE the way cpp-httplib does, then
   verify a certificate given as a PEM file against it */
#include <windows.h>
#include <wincrypt.h>
#include <stdio.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/pem.h>
int main(int argc, char **argv) {
  X509_STORE *store = X509_STORE_new();
  const wchar_t *names[] = {L"ROOT", L"CA"};
  int loaded = 0;
  for (int i = 0; i < 2; i++) {
    HCERTSTORE h = CertOpenSystemStoreW(0, names[i]);
    if (!h) continue;
    PCCERT_CONTEXT c = NULL;
    while ((c = CertEnumCertificatesInStore(h, c)) != NULL) {
      const unsigned char *d = c->pbCertEncoded;
      X509 *x = d2i_X509(NULL, &d, c->cbCertEncoded);
      if (x) { if (X509_STORE_add_cert(store, x) == 1) loaded++; X509_free(x); }
    }
    CertCloseStore(h, 0);
  }
  printf("loaded %d certificates\n", loaded);
  FILE *f = fopen(argv[1], "r");
  X509 *cert = PEM_read_X509(f, NULL, NULL, NULL);
  X509_STORE_CTX *ctx = X509_STORE_CTX_new();
  X509_STORE_CTX_init(ctx, store, cert, NULL);
  int ok = X509_verify_cert(ctx);
  printf("verify %s: %d (%s)\n", argv[1], ok, X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx)));
  return ok == 1 ? 0 : 1;
}
