/* orchard-subreaper [--tty] STATUS_FD PROGRAM [ARG...]
 *
 * The first process of every command the agent runs. It makes itself a child subreaper
 * (PR_SET_CHILD_SUBREAPER survives execve), so whatever the command starts stays in its tree
 * even when the middle of the tree exits, then execs PROGRAM with its arguments. With --tty
 * (a terminal session's command, started in a new session with the terminal on fd 0) it first
 * makes that terminal its session's controlling terminal. The agent
 * starts it with CPython's vfork path; doing the same prctl from a preexec_fn would make
 * CPython fork() the whole agent for every command.
 *
 * PROGRAM is looked up as CPython's subprocess does: taken as it is when it names a
 * directory, else tried in each entry of this environment's PATH (os.defpath without one),
 * the first error other than ENOENT or ENOTDIR kept. When no exec succeeds, the errno is
 * written to STATUS_FD (4 bytes, native order) and the process exits 127; STATUS_FD is
 * close-on-exec, so the agent reads end-of-file when the command started.
 *
 * Built static by orchard_env.agent.bundle into the bundle's bin/, so it runs in any image.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

static int exec_in_path(char **argv) {
    const char *program = argv[0];
    if (strchr(program, '/') != NULL) {
        execv(program, argv);
        return errno;
    }
    const char *path = getenv("PATH");
    if (path == NULL) {
        path = "/bin:/usr/bin";
    }
    int kept = 0;
    int last = ENOENT;
    for (;;) {
        const char *end = strchrnul(path, ':');
        char candidate[PATH_MAX];
        size_t length = (size_t)(end - path);
        int written = length == 0
            ? snprintf(candidate, sizeof candidate, "%s", program)
            : snprintf(candidate, sizeof candidate, "%.*s/%s", (int)length, path, program);
        if (written < 0 || (size_t)written >= sizeof candidate) {
            last = ENAMETOOLONG;
        } else {
            execv(candidate, argv);
            last = errno;
        }
        if (kept == 0 && last != ENOENT && last != ENOTDIR) {
            kept = last;
        }
        if (*end == '\0') {
            break;
        }
        path = end + 1;
    }
    return kept != 0 ? kept : last;
}

static void report(long status_fd, int error) {
    ssize_t ignored = write((int)status_fd, &error, sizeof error);
    (void)ignored;
}

int main(int argc, char **argv) {
    int tty = argc > 1 && strcmp(argv[1], "--tty") == 0;
    argv += tty;
    argc -= tty;
    if (argc < 3) {
        fputs("usage: orchard-subreaper [--tty] STATUS_FD PROGRAM [ARG...]\n", stderr);
        return 2;
    }
    char *rest = NULL;
    long status_fd = strtol(argv[1], &rest, 10);
    if (*argv[1] == '\0' || *rest != '\0' || status_fd < 0 || status_fd > INT_MAX
        || fcntl((int)status_fd, F_SETFD, FD_CLOEXEC) != 0) {
        fprintf(stderr, "orchard-subreaper: STATUS_FD %s is not an open descriptor\n", argv[1]);
        return 2;
    }
    if (tty && ioctl(0, TIOCSCTTY, 0) != 0) {
        report(status_fd, errno);
        return 127;
    }
    /* Without it (a kernel before 3.4) the command still runs; only its escapees do not stay. */
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int error = exec_in_path(argv + 2);
    report(status_fd, error);
    return 127;
}
