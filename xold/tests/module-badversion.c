/* module-badversion.c: a backend module whose table carries a wrong version.
 *
 * Built as libtandem-badversion.so in a directory of its own; test-lifecycle points
 * $TANDEM_BACKEND_PATH at it and checks that tandem lists the module as refused with
 * TDM_EVERSION instead of calling into it. Only the first member of the table matters: every
 * backend table starts with its ABI version, and a loader must check it before reading more.
 */

struct badversion_table {
  unsigned abi_version;
  const char *name;
  void *entries[16]; /* never read by a loader that checks the version first */
};

static const struct badversion_table table = {
    .abi_version = 0xdead0000u,
    .name = "badversion",
};

__attribute__((visibility("default"))) const void *tdm_backend_module(void);

const void *tdm_backend_module(void) { return &table; }
