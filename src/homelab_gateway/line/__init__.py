"""The line's Twisted side: slots and their waiters in process, or shared through Redis."""
