"""The HTTP server side: the channel's limits, the routes, access, in-flight requests,
answers, and the status page.
"""
