/* test-harness.c: the harness's own checks can fail (cpu:0; no device is used).
 *
 * CHECK_RC and TH_CALL must refuse a failure that set no message of its own: a stale message
 * from an earlier call, or one about another code, must not pass for it. Each such check runs
 * in a forked child whose stderr comes back through a pipe; the child must fail (status 1)
 * with the harness's complaint. The calls that set messages run before tdm_init (TDM_ENOTINIT),
 * so no tandem thread exists when the test forks.
 */
#include "harness.h"

#include <sys/wait.h>

/* A failing call that sets no message, as the streamer's acquire once did. */
static int bare_code(int code) { return code; }

/* A failing call whose message is about another code than the one it returns. */
static int other_message(int code) {
  int count = 0;
  (void)tdm_device_count(&count); /* TDM_ENOTINIT, with its message */
  return code;
}

/* Runs body in a child; checks that it failed with status 1 and that its stderr says `want`. */
static void expect_failure(void (*body)(void), const char *want) {
  int fds[2];
  CHECK(pipe(fds) == 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    dup2(fds[1], 2);
    close(fds[0]);
    body();
    _exit(0);
  }
  close(fds[1]);
  char text[2048];
  size_t n = 0;
  ssize_t got;
  while (n < sizeof text - 1 && (got = read(fds[0], text + n, sizeof text - 1 - n)) > 0)
    n += (size_t)got;
  text[n] = '\0';
  close(fds[0]);
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid);
  CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 1, "the check passed; child said: %s",
            text);
  CHECK_MSG(strstr(text, want) != NULL, "the child failed otherwise: %s", text);
}

static void stale_rc(void) {
  int count = 0;
  CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT); /* a message of its own: passes */
  CHECK_RC(bare_code(TDM_ENOTINIT), TDM_ENOTINIT);  /* the same code, its message stale */
}

static void other_rc(void) { CHECK_RC(other_message(TDM_EINVAL), TDM_EINVAL); }

static void stale_call(void) {
  int count = 0;
  CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT);
  (void)TH_CALL(bare_code(TDM_EBUSY));
}

/* A stale message does not pass for a failure that set none. */
TEST_CASE(stale_message_fails) {
  expect_failure(stale_rc, "bare_code(TDM_ENOTINIT) returned TDM_ENOTINIT but set no message");
  expect_failure(stale_call, "bare_code(TDM_EBUSY) returned TDM_EBUSY but set no message");
}

/* A message about another code, set during the call, does not pass either. */
TEST_CASE(other_code_fails) {
  expect_failure(other_rc, "names neither the code nor the call");
}

/* What passes: a call's own message, by its code or by the call's name; TDM_EAGAIN and
 * successes need none; a status checked later through TH_CALL keeps its code. */
TEST_CASE(own_message_passes) {
  int count = 0;
  CHECK_RC(tdm_device_count(&count), TDM_ENOTINIT);
  CHECK(th_message_fits("TDM_ENOTINIT: call tdm_init first", TDM_ENOTINIT, NULL));
  CHECK(th_message_fits("TDM_EINVAL: tdm_queue_sync: q is NULL", TDM_ENOMEM, "tdm_queue_sync(q)"));
  CHECK(!th_message_fits("TDM_EINVAL: x", TDM_ENOMEM, "tdm_queue_sync(q)"));
  CHECK(!th_message_fits(TH_NO_MESSAGE, TDM_EINVAL, "tdm_queue_sync(q)"));
  CHECK(!th_message_fits("TDM_EINVALID: x", TDM_EINVAL, NULL)); /* the whole name, then ':' */
  CHECK_RC(bare_code(TDM_EAGAIN), TDM_EAGAIN);
  CHECK_EQ(TH_CALL(tdm_device_count(&count)), TDM_ENOTINIT);
  CHECK_STATUS(bare_code(TDM_EBUSY), TDM_EBUSY);
  tdm_clear_error();
  CHECK(strcmp(tdm_last_error(), TH_NO_MESSAGE) == 0);
}
