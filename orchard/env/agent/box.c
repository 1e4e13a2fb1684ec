/* The compiled box: one long-lived process per sandbox that runs its commands, inside its bubblewrap.

   The same program as box.py (whose docstring states the rules and the protocol), in C: the service
   (orchard/env/agent/box_client.py) compiles it once, statically linked, binds the binary read-only into
   every sandbox and starts it there as the sandbox's uid. A Python box costs ~10 ms of CPU to start (the
   interpreter); this one well under 1 ms, and it runs in any image, with or without python3.

   Protocol, over the socket that is the box's stdin and stdout, one request at a time (integers big-endian):

     service -> box   u32 length of the rest, u8 op
       op 'R' (run):  f64 timeout (s), u32 cap (bytes kept per stream), u8 stdin given,
                      u16 n, n x (u32 resource, u64 value): `own` rlimits (the sandbox's fixed ones),
                      u16 n, n x (u32 resource, u64 value): per-command rlimits,
                      then four blocks, each u32 count, u32 bytes, and `bytes` of NUL-terminated strings:
                      argv, env ("NAME=value"), cwd (count 1), stdin (count 0: its raw bytes)
       op 'T' (times): nothing more
     box -> service   once at start: "OBX1" + u32 pid of the box (in its pid namespace)
                      per run: i32 exit code, u8 flags (1 timed out, 2 stdout truncated, 4 stderr truncated,
                      8 could not start: stderr is then "<stage>:<reason>", stage start, chdir or exec, and
                      the service words the message; 16 the box exits after this answer), u32 stdout length,
                      u32 stderr length, then both blobs
                      per times: f64 the box's own CPU seconds, f64 those of the commands it reaped

   Per command: a child in a session of its own, with the default signal dispositions, every rlimit, the cwd,
   the environment and the program looked up on the command's PATH; stdout and stderr kept up to the cap
   (the rest read and dropped); wait for the main process or the timeout; then SIGKILL every other process
   of the pid namespace (pid 1 is bubblewrap's init, which reaps them) until none is left, drain the pipes,
   and empty /tmp and /dev/shm (if that fails, the box exits after answering: the next command gets a fresh
   namespace). A command killed by signal N reports 128 + N; a timeout 124; one that could not start 127.
   Requests are at most 1 GiB. The box refuses to run anywhere but as pid 2 (under bubblewrap's init).

   `box --user UID:GID`, started as root by a root-started bubblewrap, first drops to the sandbox's uid the
   way `setpriv --reuid --regid --clear-groups --inh-caps=-all --bounding-set=-all` would (empty bounding,
   inheritable and ambient capability sets, no supplementary groups, no_new_privs), and refuses to go on if
   any step fails or root can be regained; the service then needs no setpriv exec per sandbox (~2 ms). */

#define _GNU_SOURCE
#include <dirent.h>
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define TIMED_OUT 1
#define OUT_TRUNC 2
#define ERR_TRUNC 4
#define NOT_STARTED 8
#define BOX_ENDS 16
#define MAX_REQUEST (1u << 30) /* box_client.MAX_REQUEST_BYTES */
#define MAX_LIMITS 16
#define CHUNK 65536
#define DRAIN_S 2.0
#define SETTLE_S 2.0

struct limit {
    uint32_t resource;
    uint64_t value;
};

struct request {
    double timeout;
    uint32_t cap;
    int has_stdin;
    int n_own, n_rl;
    struct limit own[MAX_LIMITS], rl[MAX_LIMITS];
    char **argv, **env;
    const char *cwd;
    const unsigned char *stdin_data;
    uint32_t stdin_len;
};

struct buffer {
    unsigned char *data;
    size_t len, cap, size; /* kept bytes, the most to keep, allocated bytes */
    int truncated;
};

static int wake_w = -1;

static void on_child(int sig) {
    int saved = errno;
    (void)sig;
    if (write(wake_w, "c", 1) < 0) { /* the pipe is full: a wake-up is pending anyway */ }
    errno = saved;
}

/* A malformed request: the service sees the socket close, reports it, and starts a fresh box. */
static void die(const char *why) {
    dprintf(2, "orchard box: %s\n", why);
    _exit(2);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int read_exact(int fd, void *buf, size_t n) {
    unsigned char *p = buf;
    while (n) {
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void write_all(int fd, const void *buf, size_t n) {
    const unsigned char *p = buf;
    while (n) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) _exit(0); /* the service is gone */
        p += k;
        n -= (size_t)k;
    }
}

/* -- parsing ------------------------------------------------------------------------------------------ */

struct cursor {
    const unsigned char *p, *end;
};

static const unsigned char *take(struct cursor *c, size_t n) {
    if ((size_t)(c->end - c->p) < n) die("short request");
    const unsigned char *at = c->p;
    c->p += n;
    return at;
}

static uint32_t u32(struct cursor *c) {
    uint32_t v;
    memcpy(&v, take(c, 4), 4);
    return be32toh(v);
}

static uint64_t u64(struct cursor *c) {
    uint64_t v;
    memcpy(&v, take(c, 8), 8);
    return be64toh(v);
}

static uint16_t u16(struct cursor *c) {
    uint16_t v;
    memcpy(&v, take(c, 2), 2);
    return be16toh(v);
}

static int limits(struct cursor *c, struct limit *out) {
    int n = u16(c);
    if (n > MAX_LIMITS) die("too many rlimits");
    for (int i = 0; i < n; i++) {
        out[i].resource = u32(c);
        out[i].value = u64(c);
    }
    return n;
}

/* A block of `count` NUL-terminated strings as a NULL-terminated array (pointing into the request). */
static char **strings(struct cursor *c, uint32_t *count_out) {
    uint32_t count = u32(c), size = u32(c);
    char *data = (char *)take(c, size);
    if (count > size) die("bad string block");
    char **out = calloc((size_t)count + 1, sizeof(char *));
    if (!out) die("out of memory");
    char *p = data, *end = data + size;
    for (uint32_t i = 0; i < count; i++) {
        char *nul = memchr(p, 0, (size_t)(end - p));
        if (!nul) die("unterminated string");
        out[i] = p;
        p = nul + 1;
    }
    if (p != end) die("bad string block");
    if (count_out) *count_out = count;
    return out;
}

static void parse(const unsigned char *buf, size_t n, struct request *r) {
    struct cursor c = {buf, buf + n};
    uint64_t bits = u64(&c);
    memcpy(&r->timeout, &bits, 8);
    r->cap = u32(&c);
    r->has_stdin = *take(&c, 1) != 0;
    r->n_own = limits(&c, r->own);
    r->n_rl = limits(&c, r->rl);
    uint32_t argc, cwdc;
    r->argv = strings(&c, &argc);
    r->env = strings(&c, NULL);
    char **cwd = strings(&c, &cwdc);
    if (argc < 1 || cwdc != 1) die("argv and cwd are required");
    r->cwd = cwd[0];
    free(cwd);
    uint32_t zero = u32(&c);
    r->stdin_len = u32(&c);
    if (zero != 0) die("bad stdin block");
    r->stdin_data = take(&c, r->stdin_len);
    if (c.p != c.end) die("trailing bytes");
    if (!(r->timeout > 0) || r->timeout > 1e9) die("bad timeout");
}

/* -- the command ---------------------------------------------------------------------------------------- */

static const char *env_get(char **env, const char *name) {
    size_t n = strlen(name);
    for (char **e = env; *e; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=') return *e + n + 1;
    return NULL;
}

/* execvpe's lookup on the command's own PATH (default /bin:/usr/bin); the first error other than "not
   there" wins. Returns only on failure, with errno set. */
static void exec_on_path(char **argv, char **env) {
    const char *name = argv[0];
    if (strchr(name, '/')) {
        execve(name, argv, env);
        return;
    }
    const char *path = env_get(env, "PATH");
    if (!path) path = "/bin:/usr/bin";
    int first = 0, last = ENOENT;
    size_t nlen = strlen(name);
    char full[4096];
    for (const char *d = path;; d++) {
        const char *colon = strchrnul(d, ':');
        size_t dlen = (size_t)(colon - d);
        if (dlen + nlen + 2 < sizeof full) {
            if (dlen == 0) {
                full[0] = '.';
                dlen = 1;
            } else {
                memcpy(full, d, dlen);
            }
            full[dlen] = '/';
            memcpy(full + dlen + 1, name, nlen + 1);
            execve(full, argv, env);
            last = errno;
            if (!first && errno != ENOENT && errno != ENOTDIR) first = errno;
        }
        d = colon;
        if (!*colon) break;
    }
    errno = first ? first : last;
}

static void child(const struct request *r, int in_r, int out_w, int err_w, int report_w) {
    const char *stage = "start";
    sigset_t none;
    sigemptyset(&none);
    setsid();
    for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (dup2(in_r, 0) < 0 || dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0) goto fail;
    for (int i = 0; i < r->n_own + r->n_rl; i++) {
        const struct limit *l = i < r->n_own ? &r->own[i] : &r->rl[i - r->n_own];
        struct rlimit v = {(rlim_t)l->value, (rlim_t)l->value};
        if (setrlimit((int)l->resource, &v) < 0) goto fail;
    }
    stage = "chdir";
    if (chdir(r->cwd) < 0) goto fail;
    stage = "exec";
    exec_on_path(r->argv, r->env);
fail:;
    char msg[512];
    int n = snprintf(msg, sizeof msg, "%s:%s", stage, strerror(errno));
    if (n > 0 && write(report_w, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1) < 0) { /* nothing */ }
    _exit(127);
}

/* Keep what fits under the cap; the buffer grows as output arrives (a large cap costs nothing unused). */
static void keep(struct buffer *b, const unsigned char *chunk, size_t n) {
    size_t room = b->cap > b->len ? b->cap - b->len : 0;
    size_t k = n < room ? n : room;
    if (k) {
        if (b->len + k > b->size) {
            size_t size = b->size ? b->size : CHUNK;
            while (size < b->len + k) size *= 2;
            if (size > b->cap) size = b->cap;
            unsigned char *grown = realloc(b->data, size);
            if (!grown) _exit(3); /* the service reports the box's death; the next command starts afresh */
            b->data = grown;
            b->size = size;
        }
        memcpy(b->data + b->len, chunk, k);
        b->len += k;
    }
    if (n > room) b->truncated = 1;
}

/* Read what a pipe has; returns 0 at EOF (or error), 1 otherwise. */
static int read_from(int fd, struct buffer *b) {
    static unsigned char chunk[CHUNK];
    ssize_t k = read(fd, chunk, sizeof chunk);
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return 1;
    if (k <= 0) return 0;
    keep(b, chunk, (size_t)k);
    return 1;
}

static void drain_wake(int fd) {
    char junk[256];
    while (read(fd, junk, sizeof junk) > 0) {
    }
}

/* SIGKILL every process of the namespace but init and the box until none is left (or wait_s passed).
   Killed processes cannot fork, so repeated passes reach the empty set even under a fork bomb; a pid stays
   listed until init has reaped it, so an empty list also means the pids limit is free again. */
static void end_all_others(pid_t me, double wait_s) {
    double deadline = now() + wait_s;
    for (;;) {
        DIR *d = opendir("/proc");
        int found = 0;
        if (d) {
            struct dirent *e;
            while ((e = readdir(d))) {
                char *endp;
                long pid = strtol(e->d_name, &endp, 10);
                if (*endp || pid <= 1 || pid == me) continue;
                found = 1;
                kill((pid_t)pid, SIGKILL);
            }
            closedir(d);
        }
        if (!found || now() > deadline) return;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
}

static int remove_entry(const char *path, const struct stat *st, int kind, struct FTW *ftw) {
    (void)st;
    if (ftw->level == 0) return 0;
    if (kind == FTW_DP) rmdir(path);
    else unlink(path);
    return 0;
}

/* Empty `path` (not crossing mounts); returns whether it is empty now. What cannot be removed this way (a
   tree deeper than PATH_MAX, a directory its owner made read-only) is left, and the caller then ends the
   box after answering, so that the next command starts in a fresh namespace with fresh scratch space. */
static int empty_dir(const char *path) {
    nftw(path, remove_entry, 32, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
    DIR *d = opendir(path);
    if (!d) return errno == ENOENT;
    struct dirent *e;
    int empty = 1;
    while (empty && (e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) empty = 0;
    closedir(d);
    return empty;
}

static void reply(int code, int flags, const struct buffer *out, const struct buffer *err) {
    unsigned char head[13];
    uint32_t c = htobe32((uint32_t)code), o = htobe32((uint32_t)out->len), e = htobe32((uint32_t)err->len);
    memcpy(head, &c, 4);
    head[4] = (unsigned char)flags;
    memcpy(head + 5, &o, 4);
    memcpy(head + 9, &e, 4);
    write_all(1, head, sizeof head);
    write_all(1, out->data, out->len);
    write_all(1, err->data, err->len);
}

/* A command that could not start: stderr carries "<stage>:<reason>" (stage start, chdir or exec), whatever the
   cap; the service words the message ("cannot run 'ls': ...") as it does for a bubblewrap per command. */
static void not_started(const char *failure, int flags) {
    struct buffer none = {NULL, 0, 0, 0, 0};
    struct buffer err = {(unsigned char *)failure, strlen(failure), 0, 0, 0};
    reply(127, flags | NOT_STARTED, &none, &err);
}

/* Run one command and answer; returns 0 when the box must end after this answer (scratch space not emptied). */
static int run(const struct request *r, pid_t me, int wake_r) {
    int out[2], err[2], in[2] = {-1, -1}, report[2];
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 || pipe2(report, O_CLOEXEC) < 0) _exit(3);
    if (r->has_stdin) {
        if (pipe2(in, O_CLOEXEC) < 0) _exit(3);
    } else {
        in[0] = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (in[0] < 0) _exit(3);
    }
    pid_t pid = fork();
    if (pid < 0) {
        char failure[300];
        snprintf(failure, sizeof failure, "start:%s", strerror(errno));
        close(out[0]); close(out[1]); close(err[0]); close(err[1]); close(report[0]); close(report[1]);
        close(in[0]);
        if (in[1] >= 0) close(in[1]);
        not_started(failure, 0);
        return 1;
    }
    if (pid == 0) child(r, in[0], out[1], err[1], report[1]);
    close(in[0]);
    close(out[1]);
    close(err[1]);
    close(report[1]);
    char failure[600];
    size_t flen = 0;
    for (;;) {
        ssize_t k = read(report[0], failure + flen, sizeof failure - 1 - flen);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) break;
        flen += (size_t)k;
        if (flen >= sizeof failure - 1) break;
    }
    failure[flen] = 0;
    close(report[0]);

    struct buffer bufs[2] = {{NULL, 0, r->cap, 0, 0}, {NULL, 0, r->cap, 0, 0}};
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    int open_out = 1, open_err = 1;
    const unsigned char *pending = r->stdin_data;
    size_t left_in = r->stdin_len;
    int in_w = in[1];
    if (in_w >= 0) {
        if (left_in) {
            fcntl(in_w, F_SETFL, O_NONBLOCK);
        } else {
            close(in_w);
            in_w = -1;
        }
    }

    double deadline = now() + r->timeout;
    int status = 0, exited = 0, timed_out = 0;
    for (;;) {
        pid_t done = waitpid(pid, &status, WNOHANG);
        if (done == pid) {
            exited = 1;
            break;
        }
        double left = deadline - now();
        if (left <= 0) {
            timed_out = 1;
            break;
        }
        struct pollfd fds[4];
        int n = 0;
        fds[n++] = (struct pollfd){wake_r, POLLIN, 0};
        if (open_out) fds[n++] = (struct pollfd){out[0], POLLIN, 0};
        if (open_err) fds[n++] = (struct pollfd){err[0], POLLIN, 0};
        if (in_w >= 0) fds[n++] = (struct pollfd){in_w, POLLOUT, 0};
        double ms = left * 1000 + 1;
        int got = poll(fds, (nfds_t)n, ms > 1e9 ? 1000000000 : (int)ms);
        if (got <= 0) continue;
        for (int i = 0; i < n; i++) {
            if (!fds[i].revents) continue;
            int fd = fds[i].fd;
            if (fd == wake_r) {
                drain_wake(wake_r);
            } else if (fd == in_w) {
                ssize_t k = write(in_w, pending, left_in < CHUNK ? left_in : CHUNK);
                if (k < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                if (k < 0) k = (ssize_t)left_in; /* the command closed its stdin */
                pending += k;
                left_in -= (size_t)k;
                if (!left_in) {
                    close(in_w);
                    in_w = -1;
                }
            } else if (fd == out[0]) {
                open_out = read_from(out[0], &bufs[0]);
            } else {
                open_err = read_from(err[0], &bufs[1]);
            }
        }
    }
    if (!exited) {
        kill(pid, SIGKILL);
        while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
    }
    if (in_w >= 0) close(in_w);
    end_all_others(me, SETTLE_S);
    double drain_until = now() + DRAIN_S;
    while (open_out || open_err) {
        double left = drain_until - now();
        if (left <= 0) break;
        struct pollfd fds[3];
        int n = 0;
        fds[n++] = (struct pollfd){wake_r, POLLIN, 0};
        if (open_out) fds[n++] = (struct pollfd){out[0], POLLIN, 0};
        if (open_err) fds[n++] = (struct pollfd){err[0], POLLIN, 0};
        if (poll(fds, (nfds_t)n, (int)(left * 1000) + 1) <= 0) continue;
        for (int i = 0; i < n; i++) {
            if (!fds[i].revents) continue;
            if (fds[i].fd == wake_r) drain_wake(wake_r);
            else if (fds[i].fd == out[0]) open_out = read_from(out[0], &bufs[0]);
            else open_err = read_from(err[0], &bufs[1]);
        }
    }
    close(out[0]);
    close(err[0]);
    int clean = empty_dir("/tmp");
    clean &= empty_dir("/dev/shm");
    int flags = (timed_out ? TIMED_OUT : 0) | (bufs[0].truncated ? OUT_TRUNC : 0) |
                (bufs[1].truncated ? ERR_TRUNC : 0) | (clean ? 0 : BOX_ENDS);
    if (flen) {
        not_started(failure, flags);
    } else {
        int code = timed_out ? 124 : WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status);
        reply(code, flags, &bufs[0], &bufs[1]);
    }
    free(bufs[0].data);
    free(bufs[1].data);
    return clean;
}

static double cpu_seconds(int who) {
    struct rusage u;
    if (getrusage(who, &u) < 0) return 0;
    return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6;
}

static void put_f64(unsigned char *at, double x) {
    uint64_t bits;
    memcpy(&bits, &x, 8);
    bits = htobe64(bits);
    memcpy(at, &bits, 8);
}

static void fail_start(const char *what) {
    dprintf(2, "orchard box: %s: %s\n", what, strerror(errno));
    _exit(3);
}

/* Become `uid`:`gid` for good, with no capability left in any set (see the header). */
static void drop_to(const char *spec) {
    char *end;
    unsigned long uid = strtoul(spec, &end, 10), gid;
    if (end == spec || *end != ':') {
        errno = EINVAL;
        fail_start("--user needs UID:GID");
    }
    gid = strtoul(end + 1, &end, 10);
    if (*end || uid == 0 || gid == 0 || uid > 0xfffffffeUL || gid > 0xfffffffeUL) {
        errno = EINVAL;
        fail_start("--user needs a non-root UID:GID");
    }
    for (int cap = 0; cap < 64; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) fail_start("dropping the bounding set");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
        fail_start("clearing ambient capabilities");
    if (setgroups(0, NULL) < 0) fail_start("setgroups");
    if (setresgid((gid_t)gid, (gid_t)gid, (gid_t)gid) < 0) fail_start("setresgid");
    if (setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0) fail_start("setresuid");
    struct __user_cap_header_struct head = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &head, data) < 0) fail_start("clearing capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) fail_start("no_new_privs");
    if (setuid(0) == 0 || getuid() != (uid_t)uid || geteuid() != (uid_t)uid || getgid() != (gid_t)gid) {
        errno = EPERM;
        fail_start("the uid switch did not hold");
    }
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--user") == 0) drop_to(argv[2]);
    else if (argc != 1) {
        errno = EINVAL;
        fail_start("usage: box [--user UID:GID]");
    }
    pid_t me = getpid();
    if (me != 2) { /* under bubblewrap the box is pid 2 (its init is 1); on a host it would kill and delete */
        errno = EPERM;
        fail_start("not in a sandbox's pid namespace (pid is not 2)");
    }
    if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0)
        for (int fd = 3; fd < 65536; fd++) close(fd);
    int wake[2];
    if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) < 0) return 3;
    wake_w = wake[1];
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    unsigned char ready[8] = {'O', 'B', 'X', '1'};
    uint32_t be_pid = htobe32((uint32_t)me);
    memcpy(ready + 4, &be_pid, 4);
    write_all(1, ready, sizeof ready);
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
        dup2(devnull, 2);
        close(devnull);
    }
    for (;;) {
        uint32_t size;
        if (read_exact(0, &size, 4) < 0) return 0;
        size = be32toh(size);
        if (size < 1 || size > MAX_REQUEST) die("bad request size");
        unsigned char *buf = malloc(size);
        if (!buf) die("out of memory");
        if (read_exact(0, buf, size) < 0) return 0;
        if (buf[0] == 'T') {
            unsigned char times[16];
            put_f64(times, cpu_seconds(RUSAGE_SELF));
            put_f64(times + 8, cpu_seconds(RUSAGE_CHILDREN));
            write_all(1, times, sizeof times);
        } else if (buf[0] == 'R') {
            struct request r;
            memset(&r, 0, sizeof r);
            parse(buf + 1, size - 1, &r);
            int clean = run(&r, me, wake[0]);
            free(r.argv);
            free(r.env);
            if (!clean) return 0;
        } else {
            die("unknown op");
        }
        free(buf);
    }
}
