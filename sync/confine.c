/*
 * confine.c — opening below a directory without following symlinks (see confine.h).
 */
#include "confine.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(SYS_openat2) && defined(__has_include)
#if __has_include(<linux/openat2.h>)
#include <linux/openat2.h>
#define RS_HAVE_OPENAT2 1
#endif
#endif

#define CONFINE_MAX_DEPTH 64 /* names in one path: far more than a checkpoint directory needs */

bool rs_confine_test_no_openat2;

int rs_confine_open(rs_confine *c, const char *dir, rs_error *err) {
    c->root_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (c->root_fd < 0) return rs_error_set(err, RS_EIO, NULL, "cannot open '%s': %s", dir, strerror(errno));
    struct stat st;
    if (fstat(c->root_fd, &st) != 0) {
        int e = errno;
        rs_confine_close(c);
        return rs_error_set(err, RS_EIO, NULL, "cannot stat '%s': %s", dir, strerror(e));
    }
    c->dev = st.st_dev;
    return RS_OK;
}

void rs_confine_close(rs_confine *c) {
    if (c->root_fd >= 0) close(c->root_fd);
    c->root_fd = -1;
}

/* An open that failed with errno `e`. */
static int open_failed(int e) {
    switch (e) {
    case ENOENT: return RS_ENOTFOUND;
    case ELOOP:       /* a symlink (openat2, or O_NOFOLLOW on the last name) */
    case EXDEV:       /* openat2: the walk would leave the directory or cross a mount point */
    case ENOTDIR:     /* a non-directory on the way; also O_DIRECTORY | O_NOFOLLOW on a symlink */
        return RS_EINVAL;
    case ENXIO:       /* a socket, or a device without a driver */
    case ENODEV:
        return RS_EUNSUPPORTED;
    default:
        errno = e;
        return RS_EIO;
    }
}

/* What was opened must be what was asked for, on the root's device. */
static int check_opened(const rs_confine *c, int fd, bool want_dir) {
    struct stat st;
    if (fstat(fd, &st) != 0) return RS_EIO;
    if (st.st_dev != c->dev) return RS_EINVAL;
    if (want_dir ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode)) return RS_EUNSUPPORTED;
    return RS_OK;
}

/* Splits `rel` (copied into buf) into its names, dropping empty ones and "."; -1 for "..", an
 * absolute path or too many names. */
static int split(const char *rel, char *buf, size_t cap, char **names) {
    size_t len = strlen(rel);
    if (rel[0] == '/' || len >= cap) return -1;
    memcpy(buf, rel, len + 1);
    int n = 0;
    for (char *p = buf; *p;) {
        char *slash = strchr(p, '/');
        if (slash) *slash = '\0';
        if (strcmp(p, "..") == 0 || n == CONFINE_MAX_DEPTH) return -1;
        if (p[0] && strcmp(p, ".") != 0) names[n++] = p;
        if (!slash) break;
        p = slash + 1;
    }
    return n;
}

/* The walk without openat2: one name at a time from dir_fd, refusing a symlink at every step. */
static int walk(const rs_confine *c, int dir_fd, char **names, int n, int last_flags, int *out) {
    if (n == 0) { /* `rel` names dir_fd itself */
        int fd = openat(dir_fd, ".", last_flags);
        if (fd < 0) return open_failed(errno);
        *out = fd;
        return RS_OK;
    }
    int cur = dir_fd;
    for (int i = 0; i < n; i++) {
        const bool last = i == n - 1;
        int flags = last ? last_flags | O_NOFOLLOW : O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
        int fd = openat(cur, names[i], flags);
        int e = errno;
        if (cur != dir_fd) close(cur);
        if (fd < 0) return open_failed(e);
        if (!last) {
            int rc = check_opened(c, fd, true);
            if (rc != RS_OK) {
                close(fd);
                return rc == RS_EUNSUPPORTED ? RS_EINVAL : rc;
            }
        }
        cur = fd;
    }
    *out = cur;
    return RS_OK;
}

int rs_confine_openat(const rs_confine *c, int dir_fd, const char *rel, bool want_dir, int *out) {
    char buf[PATH_MAX];
    char *names[CONFINE_MAX_DEPTH];
    int n = split(rel, buf, sizeof buf, names);
    if (n < 0) return RS_EINVAL;
    const int flags = want_dir ? O_RDONLY | O_DIRECTORY | O_CLOEXEC : O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
    int fd = -1, rc = RS_EIO;
    bool walked = false;
#ifdef RS_HAVE_OPENAT2
    if (!rs_confine_test_no_openat2) {
        struct open_how how;
        memset(&how, 0, sizeof how);
        how.flags = (uint64_t)flags;
        how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
        long r = syscall(SYS_openat2, dir_fd, n ? rel : ".", &how, sizeof how);
        if (r >= 0) {
            fd = (int)r;
            walked = true;
        } else if (errno != ENOSYS && errno != EPERM && errno != E2BIG) { /* not filtered: a real answer */
            return open_failed(errno);
        }
    }
#endif
    if (!walked && (rc = walk(c, dir_fd, names, n, flags, &fd)) != RS_OK) return rc;
    if ((rc = check_opened(c, fd, want_dir)) != RS_OK) {
        int e = errno;
        close(fd);
        errno = e;
        return rc;
    }
    *out = fd;
    return RS_OK;
}
