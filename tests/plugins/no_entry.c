/* no_entry.c - a shared object without loom_plugin_entry: not a plugin. Its
 * constructor creates the file $LOOM_TEST_CTOR_MARK: the loader must refuse
 * it before dlopen, so that none of its code runs. */
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

int loom_plugin_init(void);
int loom_plugin_init(void) { return 0; }

__attribute__((constructor)) static void ran(void)
{
    const char *mark = getenv("LOOM_TEST_CTOR_MARK");
    int fd = mark ? open(mark, O_WRONLY | O_CREAT, 0644) : -1;
    if (fd >= 0) close(fd);
}
